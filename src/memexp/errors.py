"""Bad input, told once: what was wrong and what is valid, in a few lines, with no traceback.

Left to itself, Hydra prints a composition error with its config search path. A run's own check
(a technique's ValueError) comes out three times: in the run's summary, as "Error executing job",
and at the end of a traceback. `train.py` goes through `main` below instead: a composition error
becomes `memexp: <what>` plus the valid choices, and a run that stopped on bad input ends with
its summary alone (its `error` line says what was wrong; the traceback is in result.json).
A full disk ends it in one line too, with the folder (`exit_if_disk_full`), and so does an
override with a number longer than Python reads (`refuse_long_numbers`).
`HYDRA_FULL_ERROR=1` still gives Hydra's own report, traceback and all. `memexp`'s subcommands
describe their errors with `describe` too. How a process stops is here as well: quietly when its
reader left (`reader_left`), at once when its work is done (`exit_done`).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from memexp.adapters.atexit import run_exit_handlers

FULL_ERROR = "HYDRA_FULL_ERROR"
# What a run's own checks raise about its config: a value or a path (memexp's techniques and
# data readers), or something Hydra or OmegaConf could not build or resolve.
BAD_INPUT = (ValueError, FileNotFoundError, HydraException, OmegaConfBaseException)


class Refused(Exception):
    """A run refused before it began (its folder is in use, or its checkpoint is not its own):
    nothing was recorded or summarized, so its message is the whole report."""


# True while `main` has set HYDRA_FULL_ERROR itself (the user did not).
_borrowed = False


def full_error_wanted() -> bool:
    """The user set HYDRA_FULL_ERROR=1: Hydra's full report, traceback and all."""
    return os.environ.get(FULL_ERROR) == "1" and not _borrowed


def describe(error: BaseException) -> str:
    """The message of a bad-input error, and the valid choices where they are known."""
    cause = error.__cause__
    if isinstance(error, MissingConfigException) and error.options:
        group, _, name = (error.missing_cfg_file or "").rpartition("/")
        return (f"{group}={name}: there is no such option\n"
                f"  valid choices for {group}: {', '.join(error.options)}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.parent_node is not None:
        return no_such_key(cause.full_key or "", cause.parent_node, str(error))
    if isinstance(error, OverrideParseException):
        return (f"{error.override}: not a valid override. Quote values with characters such "
                "as ~ or spaces, the whole argument in single quotes and the value in double "
                "ones:\n  'key=\"~/my folder\"'")
    if isinstance(cause, OmegaConfBaseException):
        # "Error merging override <override>" above OmegaConf's "<what> / full_key: ..." lines
        override = str(error).removeprefix("Error merging override ")
        return f"{override}: {first_line(str(cause))}"
    # Hydra's own messages list the options; its config search path is noise to a user.
    return str(error).split("\nConfig search path")[0].strip()


def no_such_key(full_key: str, parent: DictConfig, message: str) -> str:
    """An override of a key its config lacks: the valid keys, or why there are none; and the
    override that adds it (`+key=value`, as Hydra's `message` spells it) where the option takes
    keys it does not list (its target takes that argument, or **kwargs: model=custom passes
    exactly the keys given)."""
    node, _, key = full_key.rpartition(".")
    where = node or "the config"
    keys = [str(k) for k in parent if k != "hydra"]
    spelled = re.search(r"use (\+\S+)", message)  # "To append to your config use +a.b=1"
    add = spelled.group(1) if spelled else f"+{full_key}=..."
    if not keys:  # data.eval: null, for one
        return (f"{full_key}: {where} has no keys to set: it is null or empty in this config. "
                f"To give it '{key}', add the key: {add}")
    lines = [f"{full_key}: {where} has no key '{key}'",
             f"  valid keys of {where}: {', '.join(keys)}"]
    if takes_argument(parent, key):
        lines.append(f"  {parent._target_} takes {key}, which this config does not list: to "
                     f"give it, add the key: {add}")
    return "\n".join(lines)


def takes_argument(node: DictConfig, key: str) -> bool:
    """Whether the node's `_target_` takes `key` as an argument (by name, or **kwargs)."""
    import inspect

    from hydra.utils import get_object

    try:
        target = get_object(str(node._target_))
        parameters = inspect.signature(target).parameters.values()
    except Exception:  # no target, or one that does not import: its build will say so
        return False
    return any(p.name == key or p.kind is p.VAR_KEYWORD for p in parameters)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def abbreviated(number: str) -> str:
    """A number as a message shows it: its first digits and its length, where it is long."""
    return number if len(number) <= 24 else f"{number[:20]}... ({len(number)} digits)"


def main(hydra_main: Callable[[], None]) -> None:
    """Run a `hydra.main` function; bad config input ends it with `memexp: <what>` (exit 1)."""
    global _borrowed
    if full_error_wanted():
        hydra_main()
        return
    refuse_long_numbers(sys.argv[1:])
    # HYDRA_FULL_ERROR makes Hydra re-raise instead of printing its own report, so that the
    # error reaches this function whole.
    before, os.environ[FULL_ERROR], _borrowed = os.environ.get(FULL_ERROR), "1", True
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as error:
        sys.exit(f"memexp: {describe(error)}")
    except OSError as error:
        exit_if_disk_full(error)
        raise
    finally:
        os.environ.pop(FULL_ERROR)
        if before is not None:
            os.environ[FULL_ERROR] = before
        _borrowed = False


def refuse_long_numbers(overrides: list[str]) -> None:
    """Hydra reads an override's integer with int(), whose ValueError for more digits than
    Python converts (sys.get_int_max_str_digits) escapes its parser as a bare traceback."""
    limit = sys.get_int_max_str_digits()
    for override in overrides:
        key, _, value = override.partition("=")
        digits = re.search(rf"\d{{{limit + 1},}}", value)
        if digits:
            sys.exit(f"memexp: {key.lstrip('+~')}={abbreviated(digits.group())}: a number longer "
                     f"than Python reads ({limit} digits), and than any key takes")


# The key of the folder this process's run or sweep writes in, and the folder (RunFolder).
_folder = ("hydra.run.dir", "the run folder")


class RunFolder(Callback):
    """Notes the folder a run or a sweep writes in, for `exit_if_disk_full`: Hydra's first writes
    there (its .hydra/ config files, multirun.yaml) name no file when the disk is full, and
    Hydra has forgotten the folder by the time their error reaches `main`."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        global _folder
        _folder = ("hydra.run.dir", os.path.abspath(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _folder
        _folder = ("hydra.sweep.dir", os.path.abspath(str(config.hydra.sweep.dir)))


def exit_if_disk_full(error: OSError) -> None:
    """A write that found its disk full ends the process in one line: the folder, and the key
    that moves it."""
    if error.errno == errno.ENOSPC:
        key, folder = _folder
        raise SystemExit(f"memexp: {error.filename or folder}: no space left on device, the "
                         f"disk is full. Free some space there, or point {key} at a folder on "
                         "another disk") from None


def reader_left() -> NoReturn:
    """The reader of our output has gone (`python train.py --help | head`): stop as shell
    tools do, with no traceback. stdout goes to /dev/null first, or Python reports the broken
    pipe again when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(128 + signal.SIGPIPE)


def exit_done() -> NoReturn:
    """Exit 0 now that the run's work is written: the exit handlers run (logging's flush,
    wandb's), then the process ends without the interpreter's finalization, which frees every
    object of every module one by one: 1.7-2.2 s with torch loaded, paid by every job of a sweep.
    A thread that is not a daemon may still be writing, so where one lives the exit is the
    ordinary one, which waits for it."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        raise SystemExit(0)
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """The exit handlers, the standard streams flushed, and the end, without finalization."""
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


@contextmanager
def summarized_bad_input() -> Iterator[None]:
    """Around a single run whose failures its summary has told already: one that stopped on
    bad input exits 1 with nothing more; one refused before it began exits 1 with its message,
    and one whose disk is full with the folder. Any other error keeps its traceback."""
    if full_error_wanted():
        yield
        return
    try:
        yield
    except Refused as error:
        raise SystemExit(f"memexp: {error}") from None
    except BAD_INPUT:
        raise SystemExit(1) from None
    except OSError as error:  # before Hydra adds its "Error executing job" line
        exit_if_disk_full(error)
        raise
