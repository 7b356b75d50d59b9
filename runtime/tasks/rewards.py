"""Rule rewards and loading user reward functions from ``"pkg.module:function"`` strings.

A reward function takes the decoded completion and the reference answer (plus keyword extras such
as the prompt) and returns a float. Spec files name them by import path, so a typo must fail at
start-up with a message that says what was wrong, not as an AttributeError mid-run; and one that raises
or returns something other than a finite number mid-run, or hangs, is handled by `RewardGuard`'s stated policy.
"""

from __future__ import annotations

import difflib
import math
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction

from rlc.runtime.errors import RunError
from rlc.runtime.user_code import load_callable

__all__ = [
    "BUILTIN_REWARDS",
    "MAX_REWARD",
    "RewardFn",
    "RewardGuard",
    "RewardLoadError",
    "RewardTimeout",
    "as_score",
    "exact_match",
    "load_reward",
    "math_exact",
]

RewardFn = Callable[..., float]


def exact_match(completion: str, answer: str, **_: object) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer exactly."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), honouring nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: treat as no boxed answer


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: the last ``\\boxed{}``, else the last number, else None."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(ans: str) -> str:
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_exact(completion: str, answer: str, **_: object) -> float:
    """1.0 when the completion's final answer equals the reference after normalisation.

    The final answer is the last ``\\boxed{...}`` or else the last number. Both sides drop ``$``,
    spaces, thousands separators, ``\\text{}``; ``\\frac{a}{b}`` becomes ``a/b``; numbers compare by
    value (``7.0`` = ``7``, ``1/2`` = ``0.5``), anything else as strings.
    """
    got = extract_answer(completion)
    if got is None:
        return 0.0
    a, b = _normalise(got), _normalise(str(answer))
    if a == b:
        return 1.0
    na, nb = _as_number(a), _as_number(b)
    return 1.0 if na is not None and nb is not None and na == nb else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math_exact": math_exact}


class RewardLoadError(ImportError):
    """A reward path could not be resolved to a callable; the message says which part failed."""


def load_reward(path: str) -> RewardFn:
    """Resolve a built-in name (``exact_match``, ``math_exact``) or ``"pkg.module:function"``."""
    if path in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[path]
    if ":" not in path:
        close = difflib.get_close_matches(path, BUILTIN_REWARDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RewardLoadError(
            f"reward {path!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor of the form "
            f"'pkg.module:function'{hint}"
        )
    return load_callable(path, "reward", RewardLoadError)


class RewardTimeout(BaseException):
    """Raised inside a reward call that outlives its bound. A BaseException, so that a reward's own
    `except Exception` cannot swallow it and go on."""


def _raise_timeout(signum: int, frame: object) -> None:
    raise RewardTimeout


@contextmanager
def reward_alarm() -> Iterator[bool]:
    """While scoring, SIGALRM raises RewardTimeout; yields whether calls can be bounded (signals reach only the
    main thread, so elsewhere they cannot). An alarm someone else had pending (a repeating one too) is held off
    and then gets what is left of it back.

    SIGALRM interrupts pure Python, blocking system calls and `re` alike, for about 2 microseconds a call; a
    thread per call would cost more, and a hung thread cannot be stopped. A reward that sets its own SIGALRM
    timer (some verifiers do) replaces this bound while its own runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    pending, interval = signal.setitimer(signal.ITIMER_REAL, 0)  # disarm theirs before taking the signal over
    started = time.monotonic()
    previous = signal.getsignal(signal.SIGALRM)
    try:
        signal.signal(signal.SIGALRM, _raise_timeout)
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending > 0:
            left = max(1e-6, pending - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def call_within(fn: RewardFn, seconds: float | None, *args: object) -> float:
    """`fn(*args)`, interrupted with RewardTimeout after `seconds` (inside `reward_alarm()`); None: unbounded.
    The alarm repeats, so a reward whose bare `except:` swallowed the first one is interrupted again."""
    if seconds is None:
        return fn(*args)  # type: ignore[no-any-return]
    signal.setitimer(signal.ITIMER_REAL, seconds, seconds)
    try:
        return fn(*args)  # type: ignore[no-any-return]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _clip(text: object, limit: int = 120) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 20]}...' ({len(str(text))} chars)"


#: The largest reward magnitude accepted. Far beyond any real reward, yet small enough that every estimator's
#: float32 statistics stay finite: a group's squared deviations (≤ (2e12)² × group size), REINFORCE++'s returns
#: summed over a million-token response (≤ 1e18) and the loss over them. Rewards of 3e38 (finite in float32) gave NaN
#: GRPO advantages while its statistics were float32; in float64 they still overflow Dr. GRPO's and RLOO's float32
#: advantages (r − mean reaches twice the reward) and the loss.
MAX_REWARD = 1e12

_BEYOND = f"beyond the largest reward magnitude accepted ({MAX_REWARD:g}), where the advantages would overflow"


def as_score(value: object) -> tuple[float, str | None]:
    """`value` as a reward, and why it cannot be one (None when it can: ints, floats, bools, numpy/torch scalars
    of magnitude at most `MAX_REWARD`)."""
    if value is None:
        return 0.0, "returned None"
    if isinstance(value, str | bytes):
        return 0.0, f"returned the string {_clip(value, 60)}, not a number"
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int or Fraction past float's range, e.g. 10**400
        shown = repr(value)
        shown = shown if len(shown) <= 40 else f"{shown[:20]}... ({len(shown)} characters)"
        return 0.0, f"returned {shown}, {_BEYOND}"
    except (TypeError, ValueError):
        return 0.0, f"returned a {type(value).__name__}, not a number"
    except Exception as exc:  # the value's own __float__ failed: the user's code
        return 0.0, f"returned a {type(value).__name__} that does not convert to a number ({type(exc).__name__})"
    if not math.isfinite(number):
        return 0.0, f"returned {number}"
    if abs(number) > MAX_REWARD:
        return 0.0, f"returned {number:g}, {_BEYOND}"
    return number, None


class RewardGuard:
    """Scores samples with the user's reward function, under the plan's policy for the ones it cannot score.

    A sample whose reward raises, outlives `timeout_s` or is not a finite number within ±`MAX_REWARD` is a failed
    sample: it scores 0 and is flagged (`score_flagged`), so its whole group trains with zero advantages (0 is not
    its reward, and the group's baseline is compromised), and counted (the first is reported with its prompt and
    completion); when more than `max_failed_share` of the
    last `window` samples (one batch) failed, the run stops with a RunError naming the reward, the last failed
    sample and the reason.
    """

    def __init__(
        self,
        fn: RewardFn,
        name: str,
        window: int,
        log: Callable[[str], None],
        *,
        timeout_s: float,
        max_failed_share: float,
    ) -> None:
        self.fn, self.name, self.window, self.log = fn, name, max(1, window), log
        self.timeout_s, self.max_failed_share = timeout_s, max_failed_share
        self.allowed = int(max_failed_share * self.window)
        self.recent: deque[bool] = deque(maxlen=self.window)
        self.failed_since_step = 0
        self.reported = False

    def score_flagged(self, completions: list[str], answer: str, *, prompt: str = "") -> tuple[list[float], list[bool]]:
        """The rewards of one prompt's completions and which of them failed (one alarm set-up for the group, a
        bound on each call)."""
        with reward_alarm() as bounded:
            scored = [self._score(c, answer, prompt, bounded) for c in completions]
        return [score for score, _ in scored], [failed for _, failed in scored]

    def score_group(self, completions: list[str], answer: str, *, prompt: str = "") -> list[float]:
        """The rewards of one prompt's completions (a failed one scores 0)."""
        return self.score_flagged(completions, answer, prompt=prompt)[0]

    def __call__(self, completion: str, answer: str, *, prompt: str = "") -> float:
        return self.score_group([completion], answer, prompt=prompt)[0]

    def _score(self, completion: str, answer: str, prompt: str, bounded: bool) -> tuple[float, bool]:
        try:
            value = call_within(self.fn, self.timeout_s if bounded else None, completion, answer)
        except RewardTimeout:
            problem = f"did not return within {self.timeout_s:g} s (reward.timeout_s)"
        except Exception as exc:  # the user's code: any failure is the sample's, reported below
            problem = f"raised {type(exc).__name__}: {exc}"
        else:
            score, problem = as_score(value)
            if problem is None:
                self.recent.append(False)
                return score, False
        self.recent.append(True)
        self.failed_since_step += 1
        sample = f"(prompt {_clip(prompt)}, completion {_clip(completion)}, answer {_clip(answer)})"
        failed = sum(self.recent)
        if failed > self.allowed:
            raise RunError(
                f"reward {self.name!r} {problem} {sample}; {failed} of the last {len(self.recent)} samples "
                f"failed, and the run stops past {self.allowed} ({self.max_failed_share:.0%} of a batch of "
                f"{self.window}, reward.max_failed_share) scored 0: fix the reward function (checkpoints so far "
                "are kept; `--resume` continues)"
            )
        if not self.reported:
            self.reported = True
            self.log(
                f"warning: reward {self.name!r} {problem} {sample}; its group trains with zero advantages (up to "
                f"{self.allowed} such sample(s) per {self.window} before the run stops; `reward/failed` counts them)"
            )
        return 0.0, True

    def take_failed(self) -> int:
        """Failed samples since the last call (the step's `reward/failed` metric)."""
        count, self.failed_since_step = self.failed_since_step, 0
        return count
