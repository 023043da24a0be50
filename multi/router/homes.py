"""Where the kv policy puts a new conversation in a plain pool, and how long a conversation's
home keeps it (:meth:`multi.router.choose.Chooser.choose`'s plain instances).

A prompt of which no instance holds any prefix starts a conversation (or continues one whose
prefix the index missed): where it lands, its next turns follow (the home holds their
prefix). Conversations in flight together are ones that started together, so consecutive new
ones placed on one engine stay paired there turn after turn, and an engine given more
conversations keeps more. Among the instances whose score is within the tie band of the best,
such a prompt goes to the one given the fewest of the last :data:`WINDOW` requests the kv
policy placed (a conversation's turns, once homed, count where they are served), then to the
one given one least recently, then to the one with fewer requests in flight (two instances:
new conversations alternate, and the count evens out the conversations each holds).

A prompt that some instance holds a prefix of stays on the one holding the longest unless
that one's score exceeds the best by more than ``near**2``: the tie band is one estimate's
typical error and the comparison is of two estimates, each with its own; a turn moved by
less leaves its prefix on both engines and re-pairs its conversation with others.
"""

from __future__ import annotations

from collections import deque

from multi.router.instances import Instance

# Placements remembered (instance URLs, oldest dropped): bounded, and recent enough that an
# instance that joins the pool catches up within a window rather than taking all.
WINDOW = 32


class Homes:
    """The instances the kv policy's last :data:`WINDOW` admitted requests were placed on."""

    def __init__(self, window: int = WINDOW):
        self.recent: deque[str] = deque(maxlen=window)

    def placed(self, url: str) -> None:
        self.recent.append(url)

    def _key(self, i: Instance) -> tuple[int, int, int]:
        last = max((k for k, u in enumerate(self.recent) if u == i.url), default=-1)
        return sum(u == i.url for u in self.recent), last, i.outstanding

    def pick(self, order: list[Instance], est: dict[str, float], match, near: float) -> Instance:
        """The kv policy's plain instance (module docstring); ``est`` its scores by URL, ``order``
        the instances in turn (the last tie-break), ``match(i)`` the prefix ``i`` holds."""
        best = min(est.values())
        held = {i.url: match(i) for i in order}
        if max(held.values()) <= 0:  # a new conversation
            return min((i for i in order if est[i.url] <= best * near), key=self._key)
        home = max(order, key=lambda i: (held[i.url], -i.outstanding))
        if est[home.url] <= best * near * near:
            return home
        tied = [i for i in order if est[i.url] <= best * near]
        return min(tied, key=lambda i: (-held[i.url], i.outstanding))
