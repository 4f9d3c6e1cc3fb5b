"""materl's errors. Each class also inherits the built-in it stands for, so callers that catch
``ValueError`` or ``LookupError`` keep working; every message says what failed, the value
received, the valid choices and where."""


class MaterlError(Exception):
    """Base of every error materl raises on purpose."""


class UnknownNameError(MaterlError, LookupError):
    """A registry (or graph) was asked for a name it does not hold."""

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(MaterlError, ValueError):
    """A name was registered twice."""


class ShapeError(MaterlError, ValueError):
    """A tensor has the wrong shape, dtype or length for the op it was given to."""


class RecipeError(MaterlError, ValueError):
    """A recipe is malformed: a cycle, a missing input, a duplicate node, a scope error."""


class CompileError(MaterlError, ValueError):
    """A recipe cannot be compiled with the agents and options given."""


class RewardError(MaterlError, ValueError):
    """A reward returned something other than finite numbers of the right shape."""


class ConfigError(MaterlError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class DataError(ConfigError):
    """A dataset row (or file) is malformed: bad encoding or JSON, an empty prompt, bad chat
    messages, a column a reward reads is missing, a prompt longer than the model's context. The
    message names the file and line (or the row index)."""


class ModelNotFoundError(MaterlError, FileNotFoundError):
    """A model name or path does not resolve to loadable weights."""


class RunNotFoundError(MaterlError, FileNotFoundError):
    """A run dir is missing, or holds no metrics.jsonl records (``materl compare``)."""


class DeviceError(MaterlError, RuntimeError):
    """A tensor is on another device than the model it feeds, or a device asked for is absent."""


class EngineError(MaterlError, RuntimeError):
    """A generation engine failed or was misused."""


class ToolError(MaterlError, RuntimeError):
    """A tool server or tool call failed (recorded on the episode, not raised out of it)."""


class KernelError(MaterlError, RuntimeError):
    """A Mojo kernel is missing or failed to build."""


class OpOutputError(MaterlError, TypeError):
    """A value a custom op returned is not what the node that reads it takes (a string where a
    reward is due, a row of the wrong length...). ``node`` is the op's node: it is blamed, not the
    node that read the value."""

    def __init__(self, message: str, *, node: str):
        super().__init__(message)
        self.node = node

    def __reduce__(self):  # picklable across processes (Ray workers) with its node
        return (_op_output_error, (str(self), self.node))


def _op_output_error(message: str, node: str) -> OpOutputError:
    return OpOutputError(message, node=node)


class EpisodeError(MaterlError, RuntimeError):
    """An episode failed; the scheduler records it and leaves it out of the update."""


class StepFailedError(MaterlError, RuntimeError):
    """A training step failed as a whole: too many of its episodes failed, or none was left to
    learn from. The message lists the first error of each kind with its node and count."""


class StepTimeoutError(MaterlError, TimeoutError):
    """An episode, tool call or step ran past its time limit."""


class RecipeWarning(UserWarning):
    """A recipe that runs but probably does not mean what it says (e.g. inputs a node ignores)."""


class WorkInterrupted(MaterlError, RuntimeError):
    """A compute work item stopped because its thread was interrupted (Ctrl-C, a signal). What
    the code that awaited the item sees; the interrupt itself goes on up the interrupted thread."""


class CheckpointError(MaterlError, OSError):
    """A checkpoint cannot be written (a full disk, no permission) or does not verify against its
    manifest (a truncated, zeroed or changed file, a missing file); the message names the file."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM asked the run to stop (``materl.runtime.signals``); ``signum`` says which.
    A KeyboardInterrupt, not a MaterlError: ``except Exception`` must never swallow it."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process a signal ended: 130, 143."""
        return 128 + self.signum
