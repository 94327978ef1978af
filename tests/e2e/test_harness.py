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
