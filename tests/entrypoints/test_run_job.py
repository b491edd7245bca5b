"""``patchbay run`` never loses results: a job is checked whole before its output is touched, results are
renamed into place, and a job that stops early keeps what it finished with the error recorded (issue 14)."""

from __future__ import annotations

import json

import pytest
import yaml

from patchbay.entrypoints import cli, result_file

VOCAB = 49152  # tiny_llama's vocabulary


@pytest.fixture
def job(tmp_path, tiny_llama):
    """Write a job: JSONL request lines and a YAML naming them, the tiny model and ``outputs.path``."""

    def write(lines: list[dict], output: str = "out/results.jsonl", **settings) -> str:
        (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        config = {
            "model": {"path": str(tiny_llama), "max_model_len": 64},
            "runtime": {"threads": 2},
            "cache": {"num_blocks": 64},
            "attention": {"name": "torch_sdpa"},
            "inputs": {"file": "requests.jsonl", "sampling": {"max_tokens": 3}},
            "outputs": {"path": output, "progress": False},
        }
        for key, value in settings.items():
            section, _, name = key.partition("__")
            config[section][name] = value
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
        return str(tmp_path / "job.yaml")

    return write


GOOD = [{"id": "a", "prompt_token_ids": [5, 6, 7]}, {"id": "b", "prompt_token_ids": [8, 9]}]


def _run(config: str, capsys) -> tuple[int, str]:
    code = cli.main(["run", config])
    return code, capsys.readouterr().err


def test_a_bad_request_found_after_loading_names_file_and_line_and_leaves_old_results_alone(
    job, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert _run(job(GOOD), capsys)[0] == 0
    results = tmp_path / "out" / "results.jsonl"
    before = results.read_bytes()
    assert sorted(json.loads(line)["id"] for line in before.splitlines()) == ["a", "b"]

    code, err = _run(job([*GOOD, {"id": "c", "prompt_token_ids": [1], "logit_bias": {str(VOCAB): 1}}]), capsys)
    assert code == 2
    assert "requests.jsonl:3: <request>: request 'c': logit_bias has token ids outside the vocabulary" in err
    assert results.read_bytes() == before
    assert not list(results.parent.glob(".*.partial"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"id": None, "prompt": "hi"}, "requests.jsonl:1: id: a request id is a string or an integer, got null"),
        ({"id": [1], "prompt": "hi"}, "requests.jsonl:1: id: a request id is a string or an integer, got [1]"),
        (
            {"messages": "hello"},
            "requests.jsonl:1: <request>: request 'requests-1': 'messages' must be a non-empty list",
        ),
        ({"prompt": "x", "stop": [""]}, "requests.jsonl:1: stop: Value error, a stop string must not be empty"),
    ],
)
def test_a_malformed_request_is_a_one_line_error_naming_file_and_line(job, capsys, line, message):
    code, err = _run(job([line]), capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_an_output_path_that_is_a_directory_or_a_bad_device_is_a_one_line_error(job, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    code, err = _run(job(GOOD, output=str(tmp_path / "taken")), capsys)
    assert code == 2 and "outputs.path" in err and "is a directory" in err
    code, err = _run(job(GOOD, runtime__device="gpu7"), capsys)
    assert code == 2 and "runtime.device" in err and "'gpu7' is not a device" in err


def test_an_interrupted_job_keeps_its_finished_lines_and_records_the_error(job, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write = result_file.ResultFile.write

    def interrupt_after_first(self, record):
        if self.num_written == 1:
            raise KeyboardInterrupt
        write(self, record)

    monkeypatch.setattr(result_file.ResultFile, "write", interrupt_after_first)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["run", job(GOOD)])
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["id"] in {"a", "b"}
    assert lines[1] == {"error": "KeyboardInterrupt", "num_results": 1, "num_requests": 2}
    assert not list((tmp_path / "out").glob(".*.partial"))


def test_a_tilde_in_paths_means_the_home_directory(job, tmp_path, capsys, monkeypatch, own_cache_dir):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    code, err = _run(job(GOOD, output="~/results/job.jsonl"), capsys)
    assert code == 0, err
    assert (tmp_path / "home" / "results" / "job.jsonl").is_file()
    assert not (tmp_path / "~").exists()


def test_sigterm_keeps_the_finished_lines_and_exits_143(job, tmp_path, capsys, monkeypatch):
    import os
    import signal

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("this process already handles SIGTERM, so patchbay run leaves it alone")
    monkeypatch.chdir(tmp_path)
    write = result_file.ResultFile.write

    def terminate_after_first(self, record):
        write(self, record)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(result_file.ResultFile, "write", terminate_after_first)
    code, err = _run(job(GOOD), capsys)
    assert code == 143 and "terminated by SIGTERM; finished results kept in" in err
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[1] == {"error": "terminated by SIGTERM", "num_results": 1, "num_requests": 2}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _DiskFillsAfter:
    """``os`` for result_file, whose ``write`` stores ``budget`` more bytes, then fails with ENOSPC (a full disk)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def __getattr__(self, name):
        import os

        return getattr(os, name)

    def write(self, descriptor, data):
        import errno
        import os

        if self.budget <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = os.write(descriptor, bytes(data)[: self.budget])
        self.budget -= written
        return written


def test_a_full_results_disk_keeps_whole_lines_and_names_the_file(job, tmp_path, capsys, monkeypatch):
    """LOSS (issue 30): when the results disk filled, what the job kept ended in a cut-off line in a hidden
    ``.partial`` file the error never named.  Lines stay whole, the error names the file, the results stay."""
    monkeypatch.chdir(tmp_path)
    first_line = {}
    write = result_file.ResultFile.write

    def fill_the_disk_after_the_first_line(self, record):
        if self.num_written == 0:
            first_line.update(record)
            write(self, record)
            # Room for half of the next line: the write that fails has put part of it in the file.
            monkeypatch.setattr(result_file, "os", _DiskFillsAfter(len(json.dumps(record)) // 2))
        else:
            write(self, record)

    monkeypatch.setattr(result_file.ResultFile, "write", fill_the_disk_after_the_first_line)
    code, error = _run(job(GOOD), capsys)
    assert code == 1 and "Traceback" not in error
    assert "could not write result 2 to " in error and ".results.jsonl." in error and "No space left on device" in error
    assert "the 1 results written before are kept whole there" in error
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [first_line]  # every line whole; no room for the error line
    assert not list((tmp_path / "out").glob(".*.partial"))


def test_results_that_cannot_be_renamed_into_place_are_named_where_they_are(tmp_path, monkeypatch):
    """LOSS (issue 30): the error names the hidden file that holds the kept results."""
    results = result_file.ResultFile(tmp_path / "results.jsonl")
    results.write({"id": "a"})

    def refuse(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(result_file.os, "replace", refuse)
    with pytest.raises(result_file.ResultsNotWritten, match="its 1 results are kept there") as failure:
        results.close("stopped", num_requests=2)
    assert str(results.temporary) in str(failure.value)
    assert results.temporary.read_text().splitlines()[0] == '{"id": "a"}'
