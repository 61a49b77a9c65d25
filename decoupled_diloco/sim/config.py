"""Inputs of the goodput simulator: one frozen dataclass, with the paper's setting as defaults.

The paper (arXiv 2604.21428) names the simulator's knobs but not their values. Every default
below is either taken from the paper or chosen once, for all chip counts and all systems, to
reproduce its goodput table; `docs/simulator.md` gives the reason for each. Times are in seconds.
"""

import dataclasses
import math

SECONDS_PER_YEAR = 365.0 * 86400.0

SYSTEMS = ("dp", "elastic_dp", "decoupled")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Everything one simulated training run depends on.

    Attributes:
        num_chips: Chips allocated to the job (N).
        slice_chips: Chips per slice, the unit that fails and that elastic systems add or drop.
        mtbi_chip_s: Mean time between interruptions of one chip (paper: 1 year).
        slice_return_s: Time for a failed slice to come back (repair or replacement).
        chip_speed_cv: Coefficient of variation of per-chip step time; a synchronous group waits
            for its slowest chip every step. 0 means identical chips.
        total_tokens: Token budget of the run (paper: 1T).
        tokens_per_step: Global batch in tokens when every slice is up.
        step_s: Time of one step of a full-size group on mean-speed chips.
        startup_s: Fixed start-up cost (scheduling, compile, first restore), paid once by every
            system.
        checkpoint_s: Blocking cost of one DP checkpoint.
        checkpoint_every_steps: DP checkpoint interval; 0 picks Daly's optimum for this failure
            rate.
        restart_s: DP restart after a failure (swap in a spare slice, re-initialise, restore).
        downscale_s: Pause of an elastic group (whole elastic DP job, or one learner) that drops a
            failed slice and re-forms its mesh.
        upscale_s: Pause of an elastic group that re-adds a returned slice.
        num_learners: Learners M of the decoupled system (each gets an equal share of the slices).
        quorum: Minimum number of running learners K for the syncer to close a round.
        sync_every_steps: H, steps between two syncs of one fragment (fragments are staggered).
        salvage_on_failure: Policy (not in the paper): when a learner dies, the syncer still
            pulls its last per-step host-RAM snapshot for the rounds that close while it is away,
            so its pre-failure progress is not dropped.
        background_upscale: Policy (not in the paper): a returned slice compiles and loads state
            off the critical path and joins at a step boundary, pausing its group only
            `upscale_switch_s` instead of `upscale_s`. Applies to elastic DP and to learners.
        upscale_switch_s: Pause of a background upscale.
        dp_spares: Whether a DP restart swaps spare slices in for failed ones (the default, and
            the paper's setting), so failures during a restart are absorbed by it. False: no
            spares, the restart waits for the failed slice, so a failure during a restart starts
            it over (a local chaos run, where a killed learner must be restarted; calibration).
        seed: Seed of the failure schedule (the same schedule is used for every system).
    """

    num_chips: int = 1_200_000
    slice_chips: int = 256
    mtbi_chip_s: float = SECONDS_PER_YEAR
    slice_return_s: float = 3600.0
    chip_speed_cv: float = 0.0
    total_tokens: float = 1e12
    tokens_per_step: float = 4 * 2**20
    step_s: float = 1.0
    startup_s: float = 0.0
    checkpoint_s: float = 0.5
    checkpoint_every_steps: int = 0
    restart_s: float = 45.0
    downscale_s: float = 4.0
    upscale_s: float = 14.0
    num_learners: int = 8
    quorum: int = 1
    sync_every_steps: int = 24
    salvage_on_failure: bool = False
    background_upscale: bool = False
    upscale_switch_s: float = 1.0
    dp_spares: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_chips < self.slice_chips:
            raise ValueError(f"num_chips={self.num_chips} is smaller than one slice")
        if not 1 <= self.quorum <= self.num_learners:
            raise ValueError(f"quorum={self.quorum} must be in [1, num_learners]")
        if self.num_learners > self.num_slices:
            raise ValueError(f"num_learners={self.num_learners} exceeds {self.num_slices} slices")
        for name in ("mtbi_chip_s", "step_s", "total_tokens", "tokens_per_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def num_slices(self) -> int:
        """Number of slices; chips that do not fill a whole slice are not modelled."""
        return self.num_chips // self.slice_chips

    @property
    def failure_rate_per_s(self) -> float:
        """Cluster-wide rate of chip interruptions (1 / cluster MTBF)."""
        return self.num_slices * self.slice_chips / self.mtbi_chip_s

    @property
    def total_steps(self) -> float:
        """Full-size steps needed to consume the token budget."""
        return self.total_tokens / self.tokens_per_step

    @property
    def ideal_s(self) -> float:
        """Wall-clock of the run with no failures and no overheads of any kind."""
        return self.total_steps * self.step_s


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum checkpoint interval (compute time between checkpoints).

    Args:
        checkpoint_s: Cost of writing one checkpoint.
        mtbf_s: Mean time between failures of the whole job.

    Returns:
        The interval; reduces to Young's sqrt(2 c MTBF) when c << MTBF.
    """
    if checkpoint_s <= 0:
        return math.inf
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - (
        checkpoint_s
    )


def checkpoint_every_steps(cfg: SimConfig) -> int:
    """DP checkpoint interval in whole steps: the configured one, else Daly's optimum rounded."""
    if cfg.checkpoint_every_steps > 0:
        return cfg.checkpoint_every_steps
    interval_s = daly_interval_s(cfg.checkpoint_s, 1.0 / cfg.failure_rate_per_s)
    if math.isinf(interval_s):
        return max(1, math.ceil(cfg.total_steps))
    # Checkpoints can only be taken between steps, so round to whole (slowed-down) steps.
    return max(1, round(interval_s / (cfg.step_s * straggler_slowdown(cfg.num_chips, cfg))))


def expected_max_std_normal(n: int) -> float:
    """Expected maximum of n i.i.d. standard normals (Blom-style extreme-value approximation).

    Within 1% of the exact value for n >= 100; exact (0) for n = 1.
    """
    if n <= 1:
        return 0.0
    # Cramér's expansion of the normal maximum; accurate for the slice-to-cluster sizes we use.
    a = math.sqrt(2.0 * math.log(n))
    return a - (math.log(math.log(n)) + math.log(4.0 * math.pi)) / (2.0 * a) if n > 2 else 0.5642


def straggler_slowdown(group_chips: int, cfg: SimConfig) -> float:
    """Factor by which a synchronous group of `group_chips` chips is slower than one mean chip.

    Why: a synchronous step ends when the slowest chip finishes, so the group's step time is the
    expected maximum of its chips' step times; learners only wait for their own chips.
    """
    return 1.0 + cfg.chip_speed_cv * expected_max_std_normal(group_chips)
