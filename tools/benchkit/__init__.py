"""The benchmark harness: what every `tools/bench_NAME.py` shares, so each keeps its scenario.

- `section`: the section a benchmark writes (`results/NAME.md`) and its claims
  (`results/NAME.json`: claim, value, baseline, goal, command, date), and the headline table.
- `runs`: `python -m experiments.train` run or reused, with a time cap for fault windows.
- `syncer`: a syncer process started as an operator does, for benchmarks that call it.
- `tiny`: the tiny_lm quality setting (dp / diloco baselines, decoupled runs, time to a loss).

A bench script imports from here, never from another bench script.
"""

from tools.benchkit.runs import train
from tools.benchkit.section import RESULTS, ROOT, Claim, Section, machine_description
from tools.benchkit.syncer import serving

__all__ = ["RESULTS", "ROOT", "Claim", "Section", "machine_description", "serving", "train"]
