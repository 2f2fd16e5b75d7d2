"""The data-file task: JSONL and Parquet rows (verl's layout as it is), the hash split, and every
bad row an error at start that names the file, the row and the field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.tasks import DataError, DatasetTask
from rl.tasks.dataset import normalise


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "solution": f"#### {2 * i}"}
    for i in range(40)
]


def task(**kw):
    return DatasetTask(reward_workers=0, **kw)


def test_jsonl_rows_and_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:30] + [ROWS[35]])
    held = write_jsonl(tmp_path / "eval.jsonl", ROWS[30:])
    t = task(train_files=train, eval_files=held, solution_field="solution")
    assert (t.size("train"), t.size("eval")) == (30, 10)  # the held-out twin is not trained on
    ev = t.problems("eval", 100)
    assert [p.prompt for p in ev] == [r["prompt"] for r in ROWS[30:]]
    tr = t.problems("train", 70)
    assert t.problems("train", 30) == tr[:30]  # prefix-stable
    assert sorted(p.prompt for p in tr[:30]) == sorted(r["prompt"] for r in ROWS[:30])
    assert [p.prompt for p in tr[30:60]] != [p.prompt for p in tr[:30]]  # a new epoch order
    p = tr[0]
    assert t.demonstration(p) == f"#### {p.answer}"
    r = t.reward(p, f"so #### {p.answer}")
    assert (r.reward, r.correct, r.formatted) == (1.0, True, True)
    assert t.reward(p, "#### -1").reward == 0.0
    t.close()


def test_verl_parquet_layout_loads_unchanged(tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Natalia sold {i} clips. Twice as many?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(50)
    ]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    t = task(train_files=[path], eval_fraction=0.2)
    assert t.size("train") + t.size("eval") == 50 and t.size("eval") > 0
    p = t.problems("eval", 1)[0]
    row = t.row(p)
    assert p.meta["messages"] == row.prompt and row.data_source == "openai/gsm8k"
    assert row.extra_info["split"] == "train" and p.answer == row.answer
    assert t.reward(p, f"\\boxed{{{p.answer}}}").correct
    t.close()


def test_hash_split_puts_duplicates_on_one_side(tmp_path):
    rows = [{"prompt": f"Q{i % 25}", "answer": "1"} for i in range(100)]
    rows += [{"prompt": f"  q{i}  ", "answer": "1"} for i in range(25)]  # same, normalised
    t = task(train_files=write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.3)
    train = {normalise(p.prompt) for p in t.problems("train", t.size("train"))}
    held = {normalise(p.prompt) for p in t.problems("eval", t.size("eval"))}
    assert train and held and not train & held
    assert t.size("train") + t.size("eval") == 125
    t.close()


@pytest.mark.parametrize(
    "row, options, match",
    [
        (
            {"question": "q", "answer": "1"},
            {},
            r"row 1: field 'prompt' is missing or null \(columns: answer, question\)",
        ),
        ({"prompt": "q"}, {"answer_field": "answer"}, r"row 1: field 'answer' is missing"),
        # a type that differs from the rows before: pyarrow's reader names column and row
        ({"prompt": 3, "answer": "1"}, {}, r": cannot read: .*Column\(/prompt\).* in row 1"),
        ({"prompt": "", "answer": "1"}, {}, r"row 1: field 'prompt' must be a non-empty string"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, {}, r"row 0: .*not of chat messages"),
        ({"prompt": "q", "answer": [1]}, {}, r": cannot read: .*Column\(/answer\).* in row 1"),
        ({"prompt": "q", "answer": [1]}, {}, r"row 0: field 'answer' must be a string or a number"),
        ({"prompt": 3, "answer": "1"}, {}, r"row 0: field 'prompt' must be a non-empty string"),
        ({"prompt": "q", "answer": "1", "s": None}, {"solution_field": "s"}, r"row 1: field 's'"),
        ({"prompt": "q", "answer": "1"}, {"solution_field": "s"}, r"row 0: field 's' is missing"),
    ],
)
def test_a_bad_row_names_file_row_and_field(tmp_path, row, options, match):
    good = {"prompt": "fine", "answer": "1", "s": "#### 1"}
    rows = [good, row] if "row 1" in match else [row]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    sep = "" if match.startswith(":") else " "
    with pytest.raises(DataError, match=f"{path}{sep}{match}"):
        task(train_files=path, **options)


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match=r"does not exist"):
        task(train_files=str(tmp_path / "none.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(
        DataError, match=r"unknown file type '.csv'; valid: .jsonl, .json, .parquet"
    ):
        task(train_files=str(tmp_path / "d.csv"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"broken.jsonl: cannot read"):
        task(train_files=str(tmp_path / "broken.jsonl"))
    with pytest.raises(DataError, match="train_files is empty"):
        task()
    one = write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(DataError, match="both must be non-empty"):
        task(train_files=one)


def test_no_solutions_means_no_warm_start(tmp_path):
    t = task(train_files=write_jsonl(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(DataError, match="solution_field"):
        t.demonstration(t.problems("train", 1)[0])
    t.close()
