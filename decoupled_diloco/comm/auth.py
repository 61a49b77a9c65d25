"""Who is calling: the run token (the operator) or one learner's credential.

Every RPC carries a secret in the `x-dd-run-token` metadata. The run token itself identifies
the operator (the launcher, its evaluator, `status`), who may do anything. A learner is given
only its own credential, `learner-ID-HMAC` with HMAC-SHA256(run token, "learner:ID"): the
syncer derives it again from the run token, so it stores nothing per learner, and a learner
that holds its credential cannot forge another's (nor recover the run token). The syncer lets
a learner's credential push, pull and heartbeat only as that learner.

Checked from the metadata alone, before any request body is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import re

OPERATOR = -1  # the identity of the run token
_CREDENTIAL = re.compile(r"learner-(\d{1,9})-([0-9a-f]{64})")


def learner_credential(run_token: str, learner_id: int) -> str:
    """The secret learner `learner_id` presents instead of the run token."""
    mac = hmac.new(run_token.encode(), f"learner:{learner_id}".encode(), hashlib.sha256)
    return f"learner-{learner_id}-{mac.hexdigest()}"


def identify(presented: str, run_token: str) -> int | None:
    """`OPERATOR` for the run token, the learner id for a valid credential, else None."""
    if hmac.compare_digest(presented.encode(), run_token.encode()):
        return OPERATOR
    match = _CREDENTIAL.fullmatch(presented)
    if match is None:
        return None
    learner_id = int(match.group(1))
    want = learner_credential(run_token, learner_id)
    return learner_id if hmac.compare_digest(presented.encode(), want.encode()) else None


SCRAPE_ENV = "DD_SCRAPE_TOKEN"  # given to learners: the secret their metrics accept


def scrape_secret(run_token: str) -> str:
    """The metrics-only secret of a run: `scrape-HMAC` with HMAC-SHA256(run token, "scrape").

    Prometheus and the job page's cookie carry it instead of the run token: it reads metrics
    and the page, and grants nothing over gRPC (the syncer never accepts it for an RPC), so a
    learner that is given it, or a browser that keeps it, holds no power over the run.
    """
    mac = hmac.new(run_token.encode(), b"scrape", hashlib.sha256)
    return f"scrape-{mac.hexdigest()}"


def main() -> None:
    """`DD_RUN_TOKEN=... python -m decoupled_diloco.comm.auth LEARNER_ID`: print its credential."""
    import os
    import sys

    token = os.environ.get("DD_RUN_TOKEN", "").strip()  # as `comm.wire.run_token` reads it
    if len(sys.argv) != 2 or not sys.argv[1].isdigit() or not token:
        sys.exit("usage: DD_RUN_TOKEN=... python -m decoupled_diloco.comm.auth LEARNER_ID")
    print(learner_credential(token, int(sys.argv[1])))


if __name__ == "__main__":
    main()
