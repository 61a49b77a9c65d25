"""Requests to scale a running local job, from another terminal.

`python -m decoupled_diloco.status --workdir=RUN --add_learner` (or `--remove_learner=ID`) drops
one small JSON file per request into `RUN/scale/`; the launcher's supervisor takes them in the
order they were made (`take`), starts or ends learners (`Supervisor.join_learner`,
`Supervisor.leave_learner`), and logs each as a "membership" event in `RUN/metrics.jsonl`.
A join without an id takes the next unused one; ids stop at `decoupled.max_learners`.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

ACTIONS = ("join", "leave")
FOLDER = "scale"


def request(workdir: str | pathlib.Path, action: str, learner: int = -1) -> pathlib.Path:
    """Files one request (`action`: "join" or "leave"; `learner` -1: a join's next id).

    Raises:
      ValueError: an unknown action, a leave without a learner, or no run in `workdir`.
    """
    if action not in ACTIONS:
        raise ValueError(f"action {action!r}: expected one of {ACTIONS}")
    if action == "leave" and learner < 0:
        raise ValueError("a leave names the learner that leaves (--remove_learner=ID)")
    folder = pathlib.Path(workdir) / FOLDER
    if not (pathlib.Path(workdir) / "run_token").exists():
        raise ValueError(f"{workdir}: no run_token; is a decoupled run going on there?")
    folder.mkdir(exist_ok=True)
    name = f"{time.time_ns():020d}-{os.getpid()}-{action}.json"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps({"action": action, "learner": int(learner)}))
    tmp.replace(folder / name)  # whole, or not there: the launcher never reads half a request
    return folder / name


def take(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    """The requests filed since the last call, oldest first; each file is removed once read.

    A file that is not a sound request comes back as {"action": "invalid", "error": ...}, so
    the caller logs it rather than acting on it.
    """
    folder = pathlib.Path(workdir) / FOLDER
    if not folder.is_dir():
        return []
    taken = []
    for path in sorted(folder.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            action, learner = raw["action"], raw.get("learner", -1)
            if action not in ACTIONS or isinstance(learner, bool) or not isinstance(learner, int):
                raise ValueError(f"not a request: {raw!r}")
            taken.append({"action": action, "learner": learner})
        except (OSError, ValueError, KeyError, TypeError) as error:
            taken.append({"action": "invalid", "file": path.name, "error": str(error)[:200]})
        path.unlink(missing_ok=True)
    return taken


def apply(supervisor: Any, request: dict[str, Any]) -> None:
    """Acts on one request (`take`) through `supervisor` and logs what came of it."""
    action, learner = request["action"], request.get("learner", -1)
    if action == "join" and learner < 0:  # the next id never used in this run
        learner = 1 + max(supervisor.learner_ids(), default=-1)
    event = {"event": "membership", "kind": action, "learner": learner, "source": "status"}
    try:
        if action == "invalid":
            raise ValueError(request["error"])
        act = supervisor.join_learner if action == "join" else supervisor.leave_learner
        if not act(learner):
            raise ValueError("running already" if action == "join" else "not running")
    except ValueError as error:
        event = {**event, "event": "scale_refused", "reason": str(error)}
    supervisor.log(event)
