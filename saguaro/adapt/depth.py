"""SSD's build depth for a round: one for the batch, chosen with every request's gains.

The speculator builds every request's branches as deep as the most K asked of the batch
(``Speculator._depth``), beside a verification as long as the batch's rows; when the verification ends
first, the build is cut and the round waits for the pass in flight. A request priced as if its batch were
like it never sees that: one request at K = 3 among five at K = 1 (the int4 pair on a 2-core Xeon, chat)
made its batch wait 40-70 ms a round. So the chooser prices each request's K at each depth d the build
might go (``TreeModel.build(depth=d)``: a K below d waits for the deeper build's pass in flight), and the
batch takes the depth whose requests' best gains at K <= d sum highest; each request's K then stays within
it. At batch 1 this is the request's own best K.

Glossary:
    depth   the build's steps this round: the most K it lets a request ask (a request exploring a K one past it
            deepens it by a step)
    bar     a request's threshold for speculating: ``stay_gain`` (it speculated last round) or ``min_gain``
            times K = 0's gain; below it the request counts K = 0's gain
"""
from __future__ import annotations

import numpy as np


def batch_depth(by_depth: list[np.ndarray], bar: np.ndarray, zero: float, counted: np.ndarray) -> int:
    """The depth d in 1..len(by_depth) whose requests' best gains sum highest, the shallowest of equals.

    by_depth[d - 1]: [B, max_k + 1] the requests' gains at K = 0..max_k when the build goes d steps
    bar:             [B] the gain a request's best K must reach to be taken (else it counts ``zero``)
    counted:         [B] bool, the requests whose gains count (a seeded request chooses as if alone)
    """
    values = []
    for d, gains in enumerate(by_depth, start=1):
        top = gains[:, 1:d + 1].max(axis=1)  # the best K within the depth
        values.append(float(np.where(top >= bar, top, zero)[counted].sum()))
    return 1 + int(np.argmax(np.round(values, 9)))  # rounded: a tie is not broken by float noise
