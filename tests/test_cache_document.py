"""The user's cache files, one JSON document each (`jsonio.read_cache_document`,
`jsonio.write_cache_document`), as the cast and copy costs, the op data set and the TVM features
keep them."""

import json

from qsync_callback.jsonio import read_cache_document, write_cache_document

KEY = {"cpu": "EPYC", "torch": "2.13.0"}


def test_a_document_written_reads_back_for_its_key_and_format(tmp_path):
    path = str(tmp_path / "deeper" / "costs.json")  # the directory is made
    assert read_cache_document(path, "qsync-costs", 1, KEY, "costs cache") == (None, None)  # no file
    write_cache_document(path, "qsync-costs", 1, KEY, {"costs": {"a": 1.5}}, "costs cache")
    document, problem = read_cache_document(path, "qsync-costs", 1, KEY, "costs cache")
    assert problem is None
    assert document == {"format": "qsync-costs", "version": 1, "key": KEY, "costs": {"a": 1.5}}
    assert read_cache_document(path, "qsync-costs", 1, None, "costs cache")[0] == document  # any key


def test_a_document_of_another_format_version_or_key_is_not_read_back(tmp_path):
    path = str(tmp_path / "costs.json")
    write_cache_document(path, "qsync-costs", 1, KEY, {"costs": {}}, "costs cache")
    assert read_cache_document(path, "qsync-other", 1, KEY, "x")[1] == "not a qsync-other version 1 document"
    assert read_cache_document(path, "qsync-costs", 2, KEY, "x")[1] == "not a qsync-costs version 2 document"
    other = {**KEY, "torch": "2.14.0"}
    refused = read_cache_document(path, "qsync-costs", 1, other, "x")
    assert refused == (None, "made for another device or software")


def test_an_unreadable_file_says_why_without_repeating_its_path(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("{not json")
    document, problem = read_cache_document(str(path), "qsync-costs", 1, KEY, "costs cache")
    assert document is None and problem.startswith("invalid JSON at line 1") and str(path) not in problem
    path.write_text("[1, 2]")
    assert read_cache_document(str(path), "qsync-costs", 1, KEY, "costs cache") == (None, "not a JSON object")


def test_an_indented_document_is_written_with_sorted_keys(tmp_path):
    path = tmp_path / "costs.json"
    body = {"costs": {"b": 1, "a": 2}}
    write_cache_document(str(path), "qsync-costs", 1, KEY, body, "costs cache", indent=2)
    text = path.read_text()
    assert text.endswith("\n") and text.index('"a"') < text.index('"b"') and "\n  " in text
    assert json.loads(text)["costs"] == {"a": 2, "b": 1}
