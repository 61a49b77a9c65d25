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


DIGEST_ENV = "DD_RUN_TOKEN_SHA256"  # given to learners: lets them check the run token


def token_digest(run_token: str) -> str:
    """SHA-256 of the run token: a learner holding it can check the token, not recover it."""
    return hashlib.sha256(run_token.encode()).hexdigest()


def digest_matches(presented: str, digest: str) -> bool:
    """Whether `presented` is the run token whose `token_digest` is `digest`."""
    return bool(digest) and hmac.compare_digest(token_digest(presented), digest)


def main() -> None:
    """`DD_RUN_TOKEN=... python -m decoupled_diloco.comm.auth LEARNER_ID`: print its credential."""
    import os
    import sys

    token = os.environ.get("DD_RUN_TOKEN", "")
    if len(sys.argv) != 2 or not sys.argv[1].isdigit() or not token:
        sys.exit("usage: DD_RUN_TOKEN=... python -m decoupled_diloco.comm.auth LEARNER_ID")
    print(learner_credential(token, int(sys.argv[1])))


if __name__ == "__main__":
    main()
