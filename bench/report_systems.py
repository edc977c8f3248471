"""The page's sections on the trainer's systems: feeding a GPU from shards on one core, the last
partial batch under compilation, the checkpoint stall and sharded optimizer state. Every number
comes from the results; ``bench.report`` places the sections."""

from __future__ import annotations

from typing import Any

GPU_COMMAND = (
    "`make bench BENCH_ARGS='--only --gpu-only gpu_fed feed checkpoint_stall'` on a machine "
    "with a CUDA GPU (it writes docs/bench-gpu/)"
)


def _n(value: float) -> str:
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def feed(r: dict[str, Any], heading: str) -> list[str]:
    rates, gpu = r["images_per_sec"], r["gpu_rate"]
    names = {
        "per_image": "per image (`DataLoader`, `__getitem__` per row, collated)",
        "batched": "whole batches (`ShardBatches`, what the trainer uses)",
        "cpu_augment": "whole batches, plus crop and flip per image on the CPU",
    }
    needed = max(gpu["images_per_sec"].values())
    rows = [
        "| way of reading | images/s (wall) | images per CPU-second | of one GPU's rate |",
        "|---|---:|---:|---:|",
        *(
            f"| {names[k]} | {_n(v['wall'])} | {_n(v['cpu'])} | {v['cpu'] / needed:.2f} |"
            for k, v in rates.items()
        ),
    ]
    engines = ", ".join(f"{_n(v)} ({e})" for e, v in gpu["images_per_sec"].items())
    lines = [
        heading,
        "",
        f"Machine: {r['machine']}; load average {r.get('load_average', '?')}. Method: "
        f"{r['method']}.",
        "",
        *rows,
        "",
        f"What one GPU consumes: {engines} images/s, ResNet-50 at 224 px with every speed "
        f"switch on, synthetic batches on the device ({gpu['machine']}, "
        f"{gpu.get('date') or 'measured in the same run'}). "
        f"One core gathering whole batches delivers {r['one_core_over_gpu']}x the faster of "
        f"those per CPU-second of its own ({r['batched_over_per_image']}x the per-image path, "
        f"which delivers {r['per_image_over_gpu']}x); so one core per GPU feeds it, with the "
        "other cores of a node left to the training processes. Per CPU-second is the figure "
        "for a core of one's own: on this shared machine the process got only part of its "
        "core, which the wall rate shows. Cropping and flipping each image on the CPU as "
        f"well, a core would spend {r['cpu_augment_cores_per_gpu']} of itself per GPU, against "
        f"{needed / rates['batched']['cpu']:.2f} without; `--augment` does it on the device "
        "instead, for the whole batch in one gather.",
        "",
    ]
    if (g := r.get("gpu")) is not None:
        lines += [
            f"On {g['device']}: one core gathering pinned batches, copying them to the device "
            f"and augmenting them there fed {_n(g['images_per_sec'])} images/s; the "
            f"augmentation alone runs at {_n(g['augment_on_device_images_per_sec'])} images/s "
            "on the device.",
            "",
        ]
    return lines


def compile_tail(r: dict[str, Any]) -> list[str]:
    cost = r["cost_against_drop_seconds"]
    full = r["full_step_seconds"]
    return [
        "## The last partial batch under `torch.compile` (`bench/compile_tail.py`)",
        "",
        f"Machine: {r['machine']}. Method: {r['method']}.",
        "",
        "| policy | cost against dropping it |",
        "|---|---:|",
        f"| recompile for it (what the trainer did) | {cost['recompile_once']:.1f} s once per "
        f"process, then {cost['recompile_per_epoch_after']:.3f} s per epoch |",
        f"| pad it to a full batch, padded rows weighted 0 | {cost['pad_per_epoch']:.3f} s per "
        "epoch |",
        f"| drop it (what the trainer does now under `--compile`) | 0; "
        f"{r['images_deferred_by_drop']} images wait for the next epoch's shuffle |",
        "",
        f"The first compilation took {r['compile_seconds']:.1f} s; the partial batch compiled "
        f"again ({r['graphs_before_partial']} graph before it, {r['graphs_after_partial']} "
        f"after) for {cost['recompile_once']:.1f} s, {r['recompile_over_pad_per_epoch']}x a "
        "padded step, and full steps afterwards took "
        f"{full['after_recompile']:.3f} s against {full['before']:.3f} s before. Dropping costs "
        "no compute and loses no image for good (the sampler reshuffles each epoch); padding "
        "costs a step per epoch and lets the duplicated rows move BatchNorm's statistics. The "
        "trainer drops it whenever it compiles; `tests/training/test_speed.py` checks with the "
        "compiler's own log (`TORCH_LOGS=recompiles`) that nothing recompiles.",
        "",
    ]


def checkpoint_stall(r: dict[str, Any], heading: str) -> list[str]:
    rows = [
        "| checkpoint folder | training held, in line (before) | training held, copy then "
        "background write (now) | in line / now | the background write | steps beside it |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for target, t in r["targets"].items():
        if "error" in t:
            rows.append(f"| {target} | not measured: {t['error']} | | | | |")
            continue
        stall = t["stall_seconds"]
        rows.append(
            f"| {target} | {stall['in_line']:.3f} s ({stall['in_line_cpu']:.3f} s CPU) "
            f"| {stall['background']:.3f} s ({stall['background_cpu']:.3f} s CPU) "
            f"| {t['in_line_over_background']}x | {t['background_write_seconds']:.2f} s "
            f"| {t['steps_during_write_over_no_write']}x as long |"
        )
    return [
        heading,
        "",
        f"Machine: {r['machine']}; load average {r.get('load_average', '?')}. Method: "
        f"{r['method']}.",
        "",
        *rows,
        "",
        *CHECKPOINT_NOTES,
    ]


CHECKPOINT_NOTES = [
    "What the stall is now: a copy of the state into host memory, the only thing training",
    "waits for. On a CPU with a local disk, writing the file is itself little more than a",
    "memory copy into the page cache (the CPU columns), so moving it behind the step saves",
    "little, and the write then competes with the steps for the same cores (the last column).",
    "The gain is where the write is slower than the copy: a network share, whose flushes come",
    "back later (the held-fsync row: the in-line stall grows by the hold, the background one",
    "does not), and a GPU, where the copy is a device-to-host transfer at tens of GB/s and the",
    "steps run on the device beside the write. Azure's Nebula promises checkpoints '1,000",
    "times faster' by the same means: training waits for a copy into memory, and persisting to",
    "storage happens behind it; its figure is this page's 'in line / now' ratio for large",
    "models written to remote storage, where an in-line write takes minutes. What Nebula adds",
    "beyond it is a tier of node-local memory and disk shared across ranks; here a checkpoint",
    "is rank 0's file in the shared checkpoint folder, and a job killed mid-write resumes from",
    "the one before (`tests/training/test_checkpoint.py`).",
    "",
]


def sharded_state(r: dict[str, Any]) -> list[str]:
    labels = {
        "ddp": "DDP, whole state on every rank (`--engine ddp`)",
        "ddp_zero1": "DDP + ZeRO-1 (`--shard-optimizer-state`: `ZeroRedundancyOptimizer`)",
        "fsdp2": "FSDP2 (`fully_shard`: weights, gradients and state sharded)",
        "deepspeed_zero1": "DeepSpeed ZeRO stage 1",
        "deepspeed_zero2": "DeepSpeed ZeRO stage 2",
    }
    rows = [
        "| way | images/s (2 ranks) | optimizer state per rank | memory added per rank (RSS) "
        "| peak added per rank |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in r["variants"].items():
        if "error" in v:
            rows.append(f"| {labels.get(name, name)} | failed: {v['error'][-160:]!r} | | | |")
            continue
        rows.append(
            f"| {labels.get(name, name)} | {v['images_per_sec']:,.1f} | "
            f"{v['optimizer_state_mib']:,.0f} MiB | {v['rss_added_mib']:,.0f} MiB | "
            f"{v['peak_added_mib']:,.0f} MiB |"
        )
    ratios = r.get("ratios", {})
    zero = ratios.get("ddp_zero1")
    said = []
    if zero:
        said.append(
            f"`--shard-optimizer-state` holds {zero['optimizer_state_over_ddp']}x the optimizer "
            f"state per rank of plain DDP, at {zero['images_per_sec_over_ddp']}x its images/s."
        )
    for name in ("deepspeed_zero1", "deepspeed_zero2", "fsdp2"):
        if name in ratios:
            q = ratios[name]
            said.append(
                f"{labels[name]}: {q['optimizer_state_over_ddp']}x the state, "
                f"{q['rss_added_over_ddp']}x the memory added, {q['images_per_sec_over_ddp']}x "
                "the images/s of plain DDP."
            )
    return [
        "## Sharded optimizer state (`bench/sharded_state.py`)",
        "",
        f"Machine: {r['machine']}; load average {r.get('load_average', '?')}. Method: "
        f"{r['method']}. DeepSpeed: {r['deepspeed']}.",
        "",
        *rows,
        "",
        " ".join(said),
        "",
        *SHARDING_NOTES,
    ]


SHARDING_NOTES = [
    "How to read it. With SGD the optimizer state is one momentum buffer per weight (ResNet-50:",
    "about 90 MiB), so ZeRO stage 1 holds 1/N of it per rank; stage 2 also shards the",
    "gradients, stage 3 (FSDP2) the weights too. DeepSpeed's ZeRO keeps, beside the momentum of",
    "its partition, an fp32 copy of the partition's weights (the master weights mixed precision",
    "needs, carried in fp32 training too), counted in its state column. Its CPU accelerator",
    "also replaces Gloo's allreduce with a shared-memory kernel of its own (compiled at first",
    "use), so its images/s compare communication libraries as much as sharding; and the ways",
    "ran one after another on a shared machine whose load moved meanwhile (load average at the",
    "end above), so only large throughput differences mean anything here. Resident memory",
    "includes activations and the allocator's cached blocks, so it moves less than the state.",
    "",
    "The choice. The trainer shards with PyTorch's own `ZeroRedundancyOptimizer` under DDP: it",
    "holds as little optimizer state per rank as FSDP2 and less than DeepSpeed's stages 1 and",
    "2, keeps DDP's gradient averaging, evaluation on the plain model and every other part of",
    "the step as they were, and needs nothing beyond torch. FSDP2 shards the weights too, which",
    "the trainer's evaluation (ranks see different numbers of batches), its BatchNorm averaging",
    "and its engine-neutral checkpoints would each have to gather first, and it was the slowest",
    "here (an all-gather per block over Gloo): its savings matter for models whose weights do",
    "not fit one GPU, not ResNets. DeepSpeed installs and runs here on its CPU accelerator; it",
    "brings its own launcher, engine and checkpoint format beside the two engines the trainer",
    "already has. Checkpoints written sharded hold the whole state (gathered on rank 0) in a",
    "plain optimizer's format, and resume under Horovod, plain DDP and sharded DDP alike",
    "(`tests/training/test_sharded_state.py`).",
    "",
]


def gpu_fed(r: dict[str, Any]) -> list[str]:
    """The trainer fed from packed shards against its synthetic rate, per engine."""
    lines = [f"Machine: {r['machine']}. Method: {r['method']}.", ""]
    for engine, fed in (r.get("fed") or {}).items():
        synthetic = next(
            (
                row
                for row in r["engines"].get(engine, {}).get("steps", [])
                if "images_per_sec" in row
            ),
            None,
        )
        if "images_per_sec" not in fed or synthetic is None:
            lines += [
                f"- {engine}: not measured ({fed.get('error', 'no synthetic rate')[-200:]}).",
                "",
            ]
            continue
        lines += [
            f"- {engine}: fed from packed shards {fed['images_per_sec']:,.0f} images/s in the "
            f"last epoch (with `{' '.join(fed.get('extra', []))}`), "
            f"{fed['images_per_sec'] / synthetic['images_per_sec']:.2f} of the synthetic "
            f"{synthetic['images_per_sec']:,.0f} with the same switches.",
        ]
    # A run of one engine (--engines) says so, rather than leaving the other to be guessed.
    missing = [e for e in ("horovod", "ddp") if e not in (r.get("fed") or {})]
    lines += [f"- {engine}: not in this run." for engine in missing]
    return [*lines, ""]


def preemption(r: dict[str, Any]) -> list[str]:
    """Work lost per emulated preemption against the checkpoint interval, and the emergency
    checkpoint of a ResNet-50 (bench/preemption.py)."""
    lines = [
        "## What a Spot preemption sets training back (`bench/preemption.py`)",
        "",
        f"Machine: {r['machine']}"
        + (f", load average {r['load_average']}" if r.get("load_average") else "")
        + ". The ranks agree whether to checkpoint about every "
        f"{r['agree_seconds']:g} s of training; a node reads its Scheduled Events every "
        f"{r['poll_seconds']:g} s.",
        "",
    ]
    lost = r.get("work_lost")
    if lost is not None and "skipped" in lost:
        lines += [f"Work lost per preemption: not measured here ({lost['skipped']}).", ""]
    elif lost:
        lines += [
            "Work lost per preemption: the training task (2 ranks) on an emulated Batch node, "
            "the node killed at a random moment of its second epoch; lost is the training time "
            "from the state of the checkpoint a retry resumes from to the kill.",
            "",
            "| checkpoints | preemptions | an epoch | median work lost | most work lost | bound |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for label, s in lost.items():
            if s["checkpoint_minutes"] is not None:
                bound = f"the interval, {60 * s['checkpoint_minutes']:g} s"
            elif s["notice_seconds"] is not None:
                bound = f"the notice, {s['notice_seconds']:g} s"
            else:
                bound = "an epoch"
            lines.append(
                f"| {label} | {len(s['trials'])} | {s['epoch_seconds']:.0f} s "
                f"| {s['median_lost_seconds']:.1f} s "
                f"| {s['max_lost_seconds']:.1f} s | {bound} |"
            )
        lines.append("")
    e = r.get("emergency")
    if e:
        sizes = {x["checkpoint_mb"] for x in e["repeats"]}
        lines += [
            f"Emergency checkpoint of a {e['model']} trainer ({e['device']}, "
            f"{', '.join(f'{s:g}' for s in sorted(sizes))} MB: weights and SGD momentum), "
            f"median of {len(e['repeats'])}: {e['median_posted_to_on_disk_seconds']:.2f} s "
            "from the Preempt event posted to the file on disk; "
            f"{e['median_read_to_on_disk_seconds']:.2f} s from the node reading the notice, "
            f"of which {e['median_decided_to_on_disk_seconds']:.2f} s from the ranks' decision "
            "(the copy to host memory, the write, fsync and rename) and the rest waiting for "
            "the batch in progress to end (the next agreement point): one batch's time, "
            "seconds for a ResNet-50 on a loaded CPU, a fraction of one on a GPU. Azure gives "
            "at least 30 s; a batch that takes longer than the notice leaves the last "
            "checkpoint by time to resume from.",
            "",
        ]
    return lines
