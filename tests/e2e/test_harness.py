"""The harness's own judgement of a job's stderr: which tracebacks are Flare's."""

from __future__ import annotations

import harness


def _lines(text: str) -> list[str]:
    return [f"{line}\n" for line in text.strip("\n").split("\n")]


def test_a_traceback_raised_in_flare_code_is_flares_even_mid_line():
    stderr = _lines('''
flare: rank 0: a note[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/train.py", line 3, in main
[rank1]:     step()
[rank1]:   File "/x/instrumentation/src/flare/instrumentation/runtime.py", line 9, in step
[rank1]:     x = spans["a"]
[rank1]: KeyError: 'a'
''')
    ours = harness.flare_tracebacks(stderr)
    assert len(ours) == 1 and "KeyError" in ours[0]


def test_the_jobs_own_errors_through_flares_wrappers_are_not_flares():
    stderr = _lines('''
[rank2]: Traceback (most recent call last):
[rank2]:   File "/x/train.py", line 253, in load_shard
[rank2]:     raise RuntimeError("corrupt shard")
[rank3]: Traceback (most recent call last):
[rank2]: RuntimeError: corrupt shard
[rank3]:   File "/x/train.py", line 320, in main
[rank3]:     loss.backward()
[rank3]:   File "/x/instrumentation/src/flare/instrumentation/step_hooks.py", line 131, in backward
[rank3]:     return original(tensors, *args, **kwargs)
[rank3]: RuntimeError: Connection closed by peer
Traceback (most recent call last):
  File "/x/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
''')
    assert harness.flare_tracebacks(stderr) == []


def _report(*labels):
    return {"anomalies": [{"kind": k, "ranks": r, "cause": c, "first_step": s} for k, r, c, s in labels]}


def test_a_loaded_variant_must_say_what_the_quiet_one_said(monkeypatch):
    import pytest

    monkeypatch.setattr(harness, "VERDICTS", {})
    monkeypatch.setattr(harness, "VERDICTS_DIR", None)
    harness.agree("s", "quiet", _report(("straggler", [2], "compute", 20), ("fail_slow", [2], "compute", 20)))
    harness.agree("s", "loaded", _report(("straggler", [2], "compute", 22)))  # its fail-slow: one finding
    with pytest.raises(AssertionError, match="onset 20 -> 24"):
        harness.agree("s", "loaded", _report(("straggler", [2], "compute", 24)))
    with pytest.raises(AssertionError, match="labels"):
        harness.agree("s", "loaded", _report(("straggler", [2], "cpu", 20)))
    monkeypatch.setattr(harness, "KNOWN_LOADED_DIFFERENCES", {"known": "a known difference"})
    harness.agree("known", "quiet", _report(("straggler", [2], "cpu", 40)))
    with pytest.raises(pytest.xfail.Exception, match="a known difference"):  # said, not hidden
        harness.agree("known", "loaded", _report())


def test_verdicts_pass_between_sessions_through_the_folder(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setattr(harness, "VERDICTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "VERDICTS", {})
    harness.agree("two ranks", "quiet", _report(("straggler", [1], "compute", 20)))
    monkeypatch.setattr(harness, "VERDICTS", {})  # another session
    with pytest.raises(AssertionError, match="no anomalies"):
        harness.agree("two ranks", "loaded", _report())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two_ranks.loaded.json", "two_ranks.quiet.json"]
