"""verifiers environments, written as verifiers' own docs and examples write them (a Taskset of
Tasks with ``@vf.reward`` methods; a Toolset; an Env whose ``run`` drives the turns). They are
imported only by the verifiers worker, in the verifiers venv (tests/runtime/test_verifiers_env.py)."""
