import json

from bench.buffer import COLUMNS, main


def test_bench_smoke_writes_json_rows(tmp_path, capsys):
    out = tmp_path / "b.json"
    results = main(["--groups", "4", "--repeats", "1", "--json", str(out), "--dir", str(tmp_path)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == results and {r["variant"] for r in rows} >= {"list_of_dicts", "arrow_disk_fsync"}
    assert all(set(COLUMNS) <= set(r) for r in rows)
    assert all(r["insert_samples_per_s"] > 0 and r["sample_samples_per_s"] > 0 for r in rows)
    assert "insert_samples_per_s" in capsys.readouterr().out
