"""What a run will cost, before anything is provisioned: node-minutes by phase times the price.

Each phase is predicted as the minutes every node of the pool spends in it (the pool holds all
its nodes for the whole run, so node-minutes are that times the nodes), from this data root's own
past runs where there are any (:class:`PastRun`, kept in each run's record) and from the config
where there are none:

* allocating (nodes booting, mounting, pulling the image) and idle (the orchestrator between
  steps and before the release): the median of past runs on the same VM size;
* staging and scoring: a fixed part and a part per image (all images for staging, the test
  split for scoring), the Theil-Sen line through past runs of two sizes or more; with one size,
  the median of past runs' minutes scaled by this run's images over theirs;
* training: ``startup + work x minutes per image``, with ``work`` the images one node trains
  (epochs x training images / nodes: data parallelism shares them). The epochs are the cap
  times the median share of their cap the root's finished runs trained (early stopping ends
  most sooner), or the cap, an upper bound, without such a run; the training images are the
  train split less the slice early stopping holds out of it when there is no val split, sized
  by the trainer's own rule (``training/stopping.py``). The two are the robust line
  through past runs of the same model, processes per node and batch size (the Theil-Sen slope,
  the median of the pairwise slopes, and the median intercept), or, with one past run, its
  trainer's own images per second per node and the median startup.

Medians and the Theil-Sen line ignore a minority of outliers: a run that waited an hour for
nodes does not make the next estimate an hour longer. Without history, the guesses are the
project's own measurements where it has one (docs/performance.md) and marked as assumed.
The nodes are an input (dedicated and Spot counts), so a run moving to dedicated nodes can price
that too.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeGuard

from core.config import PipelineConfig, PoolConfig
from core.pricing import NodePrices
from training.stopping import held_out_size

PHASES = ("allocating", "staging", "training", "scoring", "idle")
# The measured phases (backends/cost.py) each estimated phase sums.
MEASURED = {
    "allocating": ("allocating",),
    "staging": ("staging",),
    "training": ("training",),
    "scoring": ("scoring",),
    "idle": ("idle between steps", "idle before release"),
}
HISTORY_RUNS = 20  # the newest past runs an estimate reads
# Images per second per training process with no history: the project's GPU measurements
# (docs/bench-gpu: ResNet-50 at 224 px on an H100, train_throughput.json; ResNet-18, trainer.json)
# and its CPU one (docs/performance.md, "Training throughput": the cnn, 2 processes on 2 cores).
# A model without a figure takes the slowest known one of its kind: an estimate errs high.
NOMINAL_PER_PROCESS = {
    "gpu": {"resnet50": 2528.0, "resnet18": 4261.0},
    "cpu": {"cnn": 780.0},
}
STAGING_FILES_PER_SEC = 776.0  # docs/performance.md, "Staging": small files, no delay
# Minutes per node with no history, by target: first guesses, replaced by the data root's own
# figures after its first run.
ASSUMED = {
    "azure": {"allocating": 10.0, "staging": 0.5, "startup": 3.0, "scoring": 2.0, "idle": 1.0},
    "local": {"allocating": 0.1, "staging": 0.0, "startup": 0.5, "scoring": 0.3, "idle": 0.2},
}


@dataclass(frozen=True)
class NodeMix:
    """The pool's nodes by kind: what the estimate prices."""

    dedicated: int
    spot: int

    @property
    def total(self) -> int:
        return self.dedicated + self.spot

    @classmethod
    def of(cls, pool: PoolConfig) -> NodeMix:
        return cls(pool.dedicated_nodes, pool.low_priority_nodes)


@dataclass(frozen=True)
class DataCounts:
    """The data version's images, as the data gate counted them (None: not known)."""

    images: int | None = None
    train: int | None = None
    test: int | None = None
    val: int | None = None  # with the train split known, None or 0: the data has no val split
    train_classes: tuple[int, ...] = ()  # the train split's images per class (): not known

    def trained_per_epoch(self) -> int | None:
        """The images an epoch trains: the train split, less the slice early stopping holds
        out of it when there is no val split (sized by the trainer's own rule; the whole split
        as one class when its classes are not known)."""
        if self.train is None or self.val:
            return self.train
        return self.train - held_out_size(self.train_classes or (self.train,))


@dataclass(frozen=True)
class Work:
    """What a run's training did, from its trainer's epoch records (and the scorer's count)."""

    model: str
    processes_per_node: int
    batch_size: int
    epochs_trained: int  # by this run's nodes (a resumed run trains fewer than its epochs)
    train_images: int  # per epoch, all ranks together
    images_per_sec: float | None  # the training loop's, all ranks together
    test_images: int | None = None
    epoch_cap: int | None = None  # the most epochs it could train (None: an older record)
    # The last epoch it reached, resumed-from epochs included (None: an older record).
    epochs_reached: int | None = None

    @property
    def share_of_cap(self) -> float | None:
        """The share of its cap the run's training reached (None: its cap is not known)."""
        if not self.epoch_cap:
            return None
        reached = self.epochs_reached if self.epochs_reached is not None else self.epochs_trained
        return reached / self.epoch_cap


@dataclass(frozen=True)
class PastRun:
    """One past run of the data root, as its record keeps it (``cost`` in ``run.json``)."""

    run_id: str
    vm_size: str
    nodes: int
    node_minutes: dict[str, float]  # the measured phases (backends/cost.py)
    paid: float | None
    complete: bool  # trained and scored (stopped or failed runs still count for spend)
    images: int | None = None
    work: Work | None = None

    def minutes(self, phase: str) -> float:
        """Minutes each node spent in an estimated phase."""
        return sum(self.node_minutes.get(m, 0.0) for m in MEASURED[phase]) / self.nodes

    @classmethod
    def from_record(cls, run_id: str, cost: object, complete: bool) -> PastRun | None:
        """The run's ``cost`` record, or None when it is not one (an older record, a run that
        rented nothing, or a value edited by hand into something else)."""
        if not isinstance(cost, dict):
            return None
        minutes, nodes = cost.get("node_minutes"), cost.get("nodes")
        if not isinstance(minutes, dict) or not _count(nodes) or not nodes:
            return None
        if not all(isinstance(k, str) and _number(v) for k, v in minutes.items()):
            return None
        work = cost.get("work")
        parsed: Work | None = None
        if isinstance(work, dict):
            try:
                parsed = Work(**work)
            except TypeError:
                parsed = None
            if parsed is not None and not (
                _count(parsed.epochs_trained) and _count(parsed.train_images)
            ):
                parsed = None
            if parsed is not None and not (_count(parsed.epoch_cap) and parsed.epoch_cap):
                parsed = replace(parsed, epoch_cap=None)
            if parsed is not None and not _count(parsed.epochs_reached):
                parsed = replace(parsed, epochs_reached=None)
        paid = cost.get("paid")
        images = cost.get("images")
        return cls(
            run_id,
            str(cost.get("vm_size", "")),
            int(nodes),
            {k: float(v) for k, v in minutes.items()},
            float(paid) if _number(paid) else None,
            complete,
            int(images) if _count(images) else None,
            parsed,
        )


def history_record(
    vm_size: str,
    nodes: int,
    node_minutes: dict[str, float],
    paid: float | None,
    images: int | None,
    work: Work | None,
    estimate: Estimate | None,
    provisional: float | None = None,
) -> dict[str, Any]:
    """What a run's record keeps of its cost: :meth:`PastRun.from_record` reads it back, and
    :func:`record_spend` what it spent (``paid``, else the ``provisional`` spend the run was
    counted for before it was measured), in ``currency`` (the prices' own)."""
    return {
        "vm_size": vm_size,
        "nodes": nodes,
        "node_minutes": node_minutes,
        "paid": paid,
        "provisional": provisional,
        "currency": estimate.prices.currency if estimate and estimate.prices else None,
        "images": images,
        "work": asdict(work) if work is not None else None,
        "estimate": estimate.as_record() if estimate is not None else None,
    }


def provisional_record(estimate: Estimate, spend: float) -> dict[str, Any]:
    """The cost a run's record keeps from its estimate until it has measured one: what the
    monthly cap counts for a run that crashes or is never measured."""
    return {
        "provisional": spend,
        "currency": estimate.prices.currency if estimate.prices else None,
        "estimate": estimate.as_record(),
    }


def record_spend(cost: object) -> tuple[float, str] | None:
    """What a run's ``cost`` record says it spent, and in what currency ("": not known, as
    ``pool.hourly_price`` is): the measured ``paid``, else the ``provisional`` spend; None when
    it spent nothing priced. An older record without a currency takes its estimate's."""
    if not isinstance(cost, dict):
        return None
    measured = isinstance(cost.get("node_minutes"), dict) and _number(cost.get("paid"))
    amount = cost.get("paid") if measured else cost.get("provisional")
    if not _number(amount):
        return None
    estimate = cost.get("estimate")
    currency = cost.get("currency")
    if currency is None and isinstance(estimate, dict):
        currency = estimate.get("currency")
    return float(amount), currency if isinstance(currency, str) else ""


def _number(value: object) -> TypeGuard[float]:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Phase:
    minutes: float  # each node's, in the phase
    basis: str  # how it was predicted, for a person


@dataclass(frozen=True)
class Estimate:
    """The run's predicted node time and cost, with how each figure was reached."""

    vm_size: str
    nodes: NodeMix
    phases: dict[str, Phase]
    prices: NodePrices | None
    history_runs: int  # past runs of the data root it was predicted from
    notes: list[str] = field(default_factory=list)

    @property
    def node_minutes(self) -> dict[str, float]:
        return {name: p.minutes * self.nodes.total for name, p in self.phases.items()}

    @property
    def total_node_minutes(self) -> float:
        return sum(self.node_minutes.values())

    @property
    def node_time(self) -> str:
        """The node time in words: node-hours, or node-minutes below an hour."""
        minutes = self.total_node_minutes
        return f"{minutes / 60:.2f} node-hours" if minutes >= 60 else f"{minutes:.1f} node-minutes"

    @property
    def wall_hours(self) -> float:
        return sum(p.minutes for p in self.phases.values()) / 60

    def cost_with(self, nodes: NodeMix) -> float | None:
        """The cost with ``nodes`` for the same time (None: no price, or no Spot price)."""
        if self.prices is None or (nodes.spot and self.prices.spot is None):
            return None
        return self.wall_hours * self.prices.for_nodes(nodes.dedicated, nodes.spot)

    @property
    def cost(self) -> float | None:
        return self.cost_with(self.nodes)

    def as_record(self) -> dict[str, Any]:
        """What the run's record and summary keep of it."""
        return {
            "vm_size": self.vm_size,
            "nodes": asdict(self.nodes),
            "node_minutes": {k: round(v, 3) for k, v in self.node_minutes.items()},
            "total_node_minutes": round(self.total_node_minutes, 3),
            "cost": None if self.cost is None else round(self.cost, 4),
            "all_dedicated": _rounded(self.cost_with(NodeMix(self.nodes.total, 0))),
            "all_spot": _rounded(self.cost_with(NodeMix(0, self.nodes.total))),
            "currency": self.prices.currency if self.prices else None,
            "price_source": self.prices.source if self.prices else None,
            "basis": {k: p.basis for k, p in self.phases.items()},
            "history_runs": self.history_runs,
            "notes": list(self.notes),
        }

    def line(self) -> str:
        """The estimate in one log line."""
        kinds = f"{self.nodes.dedicated} dedicated" + (
            f" + {self.nodes.spot} Spot" if self.nodes.spot else ""
        )
        money = (
            f"about {self.cost:.2f}{_unit(self.prices)}"
            if self.cost is not None
            else "no price (set pool.hourly_price to price it)"
        )
        source = (
            f"{self.history_runs} past run(s) of this data root"
            if self.history_runs
            else ("the config (no past run of this data root yet)")
        )
        return (
            f"estimate: {self.node_time} on {kinds} {self.vm_size} node(s), {money}; from {source}"
        )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _unit(prices: NodePrices | None) -> str:
    return f" {prices.currency}" if prices and prices.currency else ""


def theil_sen(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The Theil-Sen line through ``points``: the median of the pairwise slopes, and the median
    of ``y - slope x``; None with fewer than two distinct x."""
    slopes = [
        (y2 - y1) / (x2 - x1)
        for (x1, y1), (x2, y2) in itertools.combinations(points, 2)
        if x2 != x1
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in points)


def _by_size(runs: list[tuple[float, int | None]], size: int | None, what: str) -> Phase | None:
    """A phase that grows with the data: with past runs of two sizes or more, the Theil-Sen line
    through (their size, their minutes), a fixed part and a part per image; with one size, the
    median of their minutes scaled to ``size``; None without past runs."""
    if not runs:
        return None
    sized = [(float(own), m) for m, own in runs if own]
    line = theil_sen(sized) if size else None
    if size and line is not None:
        slope = max(line[0], 0.0)
        fixed = max(statistics.median(m - slope * x for x, m in sized), 0.0)
        return Phase(
            fixed + slope * size,
            f"{len(sized)} past runs: {fixed:.2f} min + {slope * 1000:.3f} min per 1,000 "
            f"{what} (Theil-Sen line)",
        )
    values = [m * size / own if size and own else m for m, own in runs]
    return Phase(statistics.median(values), f"{len(values)} past run(s), scaled to the {what}")


def _device(config: PipelineConfig) -> str:
    return "gpu" if config.target == "azure" else "cpu"


def _nominal_rate(config: PipelineConfig) -> tuple[float, str]:
    """Images per second per node with no history, and where the figure comes from."""
    kind = _device(config)
    table = NOMINAL_PER_PROCESS[kind]
    model = config.training.model
    per_process = table.get(model, min(table.values()))
    where = "an H100" if kind == "gpu" else "this project's 2-core CPU machine"
    measured = (
        f"measured on {where}"
        if model in table
        else f"assumed as {min(table, key=table.__getitem__)} on {where}"
    )
    per_node = per_process * config.pool.processes_per_node
    return per_node, f"{per_node:.0f} images/s per node ({model}, {measured})"


def _epochs(cap: int, history: list[PastRun]) -> tuple[float, str]:
    """The epochs a run capped at ``cap`` is expected to train, and how that was reached: the
    cap times the median share of their cap that the data root's finished runs reached (early
    stopping ends most before it; a resumed run counts the epochs of the checkpoint it resumed
    from), or the cap itself, an upper bound, with no such run."""
    shares = [
        share
        for r in history
        if r.complete and r.work is not None and (share := r.work.share_of_cap) is not None
    ]
    if not shares:
        return float(cap), (
            f"up to {cap} epoch(s): the cap, an upper bound (no past run of this data root "
            "says how much sooner early stopping ends)"
        )
    share = min(statistics.median(shares), 1.0)
    return cap * share, (
        f"{cap * share:.1f} of the {cap} epoch(s) capped (the median share of their cap "
        f"that {len(shares)} past run(s) trained: {share:.0%})"
    )


def _training(
    config: PipelineConfig, nodes: int, counts: DataCounts, history: list[PastRun]
) -> tuple[Phase | None, str | None]:
    t = config.training
    same = [
        r
        for r in history
        if r.work is not None
        and r.vm_size == config.pool.vm_size
        and (r.work.model, r.work.processes_per_node, r.work.batch_size)
        == (t.model, config.pool.processes_per_node, t.batch_size)
    ]
    train = counts.trained_per_epoch()
    if train is None:
        known = [r.work.train_images for r in same if r.work is not None]
        train = known[0] if known else None
    if train is None:
        rate, how = _nominal_rate(config)
        return None, (
            "the training images are not known yet (the data gate counts them); each epoch "
            f"takes each node about 1 min per {rate * 60:,.0f} images ({how})"
        )
    epochs, trained = _epochs(t.epoch_cap(), history)
    work = epochs * train / nodes
    points = [
        (r.work.epochs_trained * r.work.train_images / r.nodes, r.minutes("training"))
        for r in same
        if r.work is not None
    ]
    line = theil_sen(points) if len(points) >= 2 else None
    if line is not None and line[0] > 0:
        slope, startup = line
        basis = (
            f"{len(points)} past runs of {t.model}: {max(startup, 0):.2f} min to start, "
            f"{1 / (slope * 60):.0f} images/s per node (Theil-Sen line)"
        )
    else:
        rates = [r.work.images_per_sec / r.nodes for r in same if r.work and r.work.images_per_sec]
        if rates:
            rate = statistics.median(rates)
            slope = 1 / (60 * rate)
            startup = statistics.median(m - slope * u for u, m in points)
            basis = (
                f"{len(rates)} past run(s) of {t.model}: {rate:.0f} images/s per node, "
                f"{max(startup, 0):.2f} min to start"
            )
        else:
            rate, how = _nominal_rate(config)
            slope = 1 / (60 * rate)
            startup = ASSUMED[config.target]["startup"]
            basis = f"no past run of this shape: {how}, {startup:g} min to start (assumed)"
    minutes = max(startup, 0.0) + slope * work
    what = f"{trained} x {train} images on {nodes} node(s); {basis}"
    return Phase(minutes, what), None


def estimate_run(
    config: PipelineConfig,
    history: list[PastRun],
    counts: DataCounts | None = None,
    prices: NodePrices | None = None,
    nodes: NodeMix | None = None,
) -> Estimate:
    """The estimate for a run of the effective ``config`` on ``nodes`` (default: the pool's),
    from the data root's ``history`` (newest first) and the data version's ``counts``."""
    nodes = nodes or NodeMix.of(config.pool)
    counts = counts or DataCounts()
    assumed = ASSUMED[config.target]
    similar = [r for r in history[:HISTORY_RUNS] if r.vm_size == config.pool.vm_size]
    done = [r for r in similar if r.complete]
    phases: dict[str, Phase] = {}
    notes: list[str] = []

    def median_of(phase: str) -> Phase:
        values = [r.minutes(phase) for r in done]
        if values:
            return Phase(statistics.median(values), f"median of {len(values)} past run(s)")
        return Phase(assumed[phase], "no past run: assumed")

    phases["allocating"] = median_of("allocating")
    staged = _by_size([(r.minutes("staging"), r.images) for r in done], counts.images, "images")
    if staged is not None:
        phases["staging"] = staged
    elif config.target == "azure" and counts.images:
        minutes = assumed["staging"] + counts.images / STAGING_FILES_PER_SEC / 60
        phases["staging"] = Phase(minutes, f"no past run: {STAGING_FILES_PER_SEC:.0f} files/s")
    else:
        phases["staging"] = Phase(assumed["staging"], "no past run: assumed")
    training, why = _training(config, nodes.total, counts, history[:HISTORY_RUNS])
    if training is None:
        notes.append(f"training is not in this estimate: {why}")
    else:
        phases["training"] = training
    scored = _by_size(
        [(r.minutes("scoring"), r.work.test_images if r.work else None) for r in done],
        counts.test,
        "test images",
    )
    phases["scoring"] = scored or Phase(assumed["scoring"], "no past run: assumed")
    phases["idle"] = median_of("idle")
    return Estimate(config.pool.vm_size, nodes, phases, prices, len(similar), notes)
