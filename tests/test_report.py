"""jaxpe.train.report: the table shows each encoding's mean ± std in the right column."""
import json

import pytest

from jaxpe.train import report


def comparison(tmp_path, name, metric, rows):
    path = tmp_path / name
    path.mkdir()
    data = {"task": name, "metric": metric, "splits": list(rows[0]["splits"]), "rows": rows, "seeds": [0, 1]}
    (path / "compare.json").write_text(json.dumps(data))
    return path


def test_table_places_each_value(tmp_path):
    a = comparison(tmp_path, "copy", "token_error", [
        {"pe": "cope", "splits": {"valid": {"token_error": 0.012, "token_error_std": 0.002},
                                  "ood": {"token_error": 0.5}}},
        {"pe": "rope", "splits": {"valid": {"token_error": 0.25, "token_error_std": 0.05},
                                  "ood": {"token_error": 0.75}}}])
    b = comparison(tmp_path, "lm", "bits_per_byte", [
        {"pe": "rope", "splits": {"valid": {"bits_per_byte": 2.12345}}}])
    lines = report.comparison_table([a, b], splits=["valid"], labels=["copy", "lm"]).splitlines()
    assert lines[0] == "| pe | copy: valid | lm: valid |"
    assert lines[2] == "| cope | **1.2** ± 0.2 | — |"
    assert lines[3] == "| rope | 25.0 ± 5.0 | 2.123 |"  # alone in its column: nothing to beat
    full = report.comparison_table([a]).splitlines()
    assert full[0] == "| pe | copy: valid | copy: ood |" and full[2].endswith("| **50.0** |")
    assert full[3].endswith("| 75.0 |")
    tie = comparison(tmp_path, "tie", "seq_error", [  # equal as shown (one decimal): both bold
        {"pe": "cope", "splits": {"test": {"seq_error": 0.0041}}},
        {"pe": "none", "splits": {"test": {"seq_error": 0.0039}}},
        {"pe": "rope", "splits": {"test": {"seq_error": 0.02}}}])
    assert [line.split(" | ")[1] for line in report.comparison_table([tie]).splitlines()[2:5]] == [
        "**0.4** |", "**0.4** |", "2.0 |"]
    with pytest.raises(ValueError, match="is not a compare.json"):
        report.comparison_table([tmp_path / "missing"])
    with pytest.raises(ValueError, match="len\\(labels\\)=1"):
        report.comparison_table([a, b], labels=["x"])
