"""Sign-in throttling, the password rule, and the bounded pool that runs argon2 (issue 10, finding 4).

Guessing is slowed per account from one address, per address and per account: the first free wrong passwords cost
nothing, each one after that doubles the wait before the next attempt is even checked (1 s, 2 s, 4 s ... up to
``MAX_WAIT_S``). An attempt inside the wait is answered 429 with Retry-After at once, without running argon2, so a
guessing loop costs the leader almost nothing. A right password clears its account's counts.

Each account's guesser is held first by the pair (address, account): ``FREE_FAILURES``. An address gets more
(``FREE_FAILURES_PER_ADDRESS``, over all accounts: a household or an office shares one). The account's count over
every address (``FREE_FAILURES_PER_ACCOUNT``) bounds guessing spread over many addresses, but it does not hold up an
address the account signed in from before: throttled per account alone, anyone could keep an account locked out by
failing one sign-in every few minutes, its owner included.

argon2 (64 MiB and ~50 ms of CPU a hash) runs in a pool of its own, ``HASH_THREADS`` at a time, with at most
``HASH_QUEUE`` waiting: 60 parallel login loops used to take every worker thread from the database and make a
signed-in user's request take 3-6 s; now the excess sign-ins get a 429 and everyone else is served.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict

import trio

from swarm.errors import BadRequest, TooManyAttempts

# NIST SP 800-63B §5.1.1.2: memorized secrets of at least 8 characters, no other composition rules.
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024  # argon2 takes any length; a megabyte password is a denial of service, not a secret

FREE_FAILURES = 5  # per account from one address: typos and a forgotten caps lock
FREE_FAILURES_PER_ADDRESS = 20
FREE_FAILURES_PER_ACCOUNT = 50  # from every address but those the account signed in from
MAX_WAIT_S = 300.0
FORGET_AFTER_S = 3600.0  # an hour without failures clears an entry
KNOWN_ADDRESS_S = 30 * 86400.0  # how long an address an account signed in from counts as the owner's
MAX_ENTRIES = 100_000  # bounded memory: the oldest entries go first

HASH_THREADS = 2
HASH_QUEUE = 16


def check_password_rule(password: object) -> str:
    """``password`` if it is a string a user may pick; BadRequest saying what is wrong otherwise."""
    if not isinstance(password, str):
        raise BadRequest("the password must be a string.", "invalid_password")
    if len(password) < MIN_PASSWORD_CHARS:
        raise BadRequest(f"a password needs at least {MIN_PASSWORD_CHARS} characters; a few words together make a "
                         "good one.", "password_too_short")
    if len(password) > MAX_PASSWORD_CHARS:
        raise BadRequest(f"a password has at most {MAX_PASSWORD_CHARS} characters.", "password_too_long")
    return password


@dataclasses.dataclass
class _Failures:
    count: int = 0
    last: float = 0.0


class SignInThrottle:
    """Failure counts per account and per address; ``clock`` is injectable for tests."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._entries: OrderedDict[tuple[str, ...], _Failures] = OrderedDict()

    @staticmethod
    def _wait(entry: _Failures | None, free: int) -> float:
        if entry is None or entry.count < free:
            return 0.0
        return min(MAX_WAIT_S, 2.0 ** (entry.count - free))

    def _live(self, key: tuple, now: float, keep_s: float = FORGET_AFTER_S) -> _Failures | None:
        entry = self._entries.get(key)
        if entry is not None and now - entry.last > keep_s:
            del self._entries[key]
            return None
        return entry

    def check(self, account: str, address: str) -> None:
        """Raise TooManyAttempts if any of its keys must still wait; call before checking a password."""
        now = self.clock()
        account = account.casefold()
        keys = [(("pair", account, address), FREE_FAILURES), (("address", address), FREE_FAILURES_PER_ADDRESS)]
        if self._live(("known", account, address), now, KNOWN_ADDRESS_S) is None:
            keys.append((("account", account), FREE_FAILURES_PER_ACCOUNT))
        retry = 0.0
        for key, free in keys:
            entry = self._live(key, now)
            if entry is not None:
                retry = max(retry, entry.last + self._wait(entry, free) - now)
        if retry > 0:
            raise TooManyAttempts(
                f"too many wrong passwords; try again in {math.ceil(retry)} s.", math.ceil(retry))

    def _touch(self, key: tuple, now: float, count: int) -> None:
        entry = self._entries.pop(key, None) or _Failures()
        entry.count += count
        entry.last = now
        self._entries[key] = entry  # most recent last
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)

    def failed(self, account: str, address: str) -> None:
        now = self.clock()
        account = account.casefold()
        for key in (("pair", account, address), ("address", address), ("account", account)):
            self._touch(key, now, 1)

    def succeeded(self, account: str, address: str) -> None:
        """The right password: the account's counts are cleared, and ``address`` is the owner's from now on."""
        account = account.casefold()
        self._entries.pop(("pair", account, address), None)
        self._entries.pop(("account", account), None)
        self._touch(("known", account, address), self.clock(), 0)


class HashPool:
    """Runs password hashing in at most HASH_THREADS threads of its own, with at most HASH_QUEUE callers waiting."""

    def __init__(self, threads: int = HASH_THREADS, queue: int = HASH_QUEUE):
        self.limiter = trio.CapacityLimiter(threads)
        self.queue = queue
        self._waiting = 0

    async def run(self, fn, *args):
        if self._waiting >= self.queue + self.limiter.total_tokens:
            raise TooManyAttempts("the leader is busy checking other sign-ins; try again in a few seconds.", 2)
        self._waiting += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        finally:
            self._waiting -= 1


__all__ = ["HashPool", "SignInThrottle", "TooManyAttempts", "check_password_rule", "MIN_PASSWORD_CHARS"]
