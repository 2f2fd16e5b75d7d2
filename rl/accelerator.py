"""Whether this host has an accelerator that JAX is not using, and the install line that fixes it.

A host is taken to have one by its device files, found as JAX finds them (jax._src.hardware_utils)
without starting any backend: an NVIDIA GPU by /dev/nvidia<N>, a Cloud TPU by a Google PCI device
with a TPU device id. JAX logs a similar warning of its own, which logging setups often hide and
which names no install line.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of TPU chips (v3, plc, v4, v5p, v5e, v6e, 7x), as jax._src.hardware_utils lists
# them; other Google devices (a gVNIC network card) share the vendor id.
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")

INSTALL = {
    "gpu": 'python -m pip install -e ".[cuda13]"  (".[cuda12]" with a CUDA 12 driver)',
    "tpu": 'python -m pip install -e ".[tpu]"',
}
NAMES = {"gpu": "an NVIDIA GPU", "tpu": "a TPU"}


def detect(dev: str = "/dev", pci: str = "/sys/bus/pci/devices") -> str | None:
    """The accelerator this host's device files show: 'gpu' (NVIDIA), 'tpu' or None."""
    if glob.glob(os.path.join(dev, "nvidia[0-9]*")):
        return "gpu"
    for vendor in glob.glob(os.path.join(pci, "*", "vendor")):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                if f.read().strip() == GOOGLE_PCI_VENDOR and g.read().strip() in TPU_PCI_DEVICES:
                    return "tpu"
        except OSError:  # a device without a readable id is not a TPU we can use
            continue
    return None


def warning(
    backend: str,
    env: Mapping[str, str] | None = None,
    *,
    dev: str = "/dev",
    pci: str = "/sys/bus/pci/devices",
) -> str | None:
    """The warning for a run on JAX's CPU backend on a host with an accelerator, naming the
    install line for it; None when JAX uses an accelerator, the host has none, or the user set
    JAX_PLATFORMS=cpu (the run is on the CPU on purpose)."""
    env = os.environ if env is None else env
    if backend != "cpu" or env.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None
    kind = detect(dev, pci)
    if kind is None:
        return None
    return (
        f"warning: this host has {NAMES[kind]}, but JAX runs on its CPU backend only (its "
        f"{kind.upper()} plugin is not installed, or did not start): this run uses the CPU. "
        f"Install it with: {INSTALL[kind]}; `python -m launch.doctor` shows what JAX sees. Set "
        "JAX_PLATFORMS=cpu to run on the CPU on purpose."
    )
