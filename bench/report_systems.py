"""The page's sections on the trainer's systems: feeding a GPU from shards on one core, the last
partial batch under compilation, the checkpoint stall and sharded optimizer state. Figures and
tables from the results (how to read them: docs/benchmarks.md); ``bench.report`` places the
sections."""

from __future__ import annotations

from typing import Any

GPU_COMMAND = (
    "`make bench BENCH_ARGS='--only --gpu-only gpu_fed feed checkpoint_stall'` on a machine "
    "with a CUDA GPU (it writes docs/bench-gpu/)"
)


def _n(value: float) -> str:
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def _why(anchor: str) -> str:
    return f"How it measures and how to read it: [benchmarks.md](benchmarks.md#{anchor})."


def _figures(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), ""]


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
    figures = [
        (
            f"what one GPU consumes ({gpu['machine']}, "
            f"{gpu.get('date') or 'measured in the same run'})",
            f"{engines} images/s",
        ),
        (
            "one core's whole batches, per CPU-second, against the faster GPU rate",
            f"{r['one_core_over_gpu']}x",
        ),
        ("whole batches against the per-image path", f"{r['batched_over_per_image']}x"),
        ("the per-image path against the GPU rate", f"{r['per_image_over_gpu']}x"),
        (
            "a core's share per GPU with crops and flips on the CPU / without",
            f"{r['cpu_augment_cores_per_gpu']} / {needed / rates['batched']['cpu']:.2f}",
        ),
    ]
    if (g := r.get("gpu")) is not None:
        figures += [
            (
                f"on {g['device']}: one core gathering pinned batches, augmenting on the device",
                f"{_n(g['images_per_sec'])} images/s",
            ),
            (
                "the augmentation alone on the device",
                f"{_n(g['augment_on_device_images_per_sec'])} images/s",
            ),
        ]
    return [
        heading,
        "",
        f"Machine: {r['machine']}; load average {r.get('load_average', '?')}. Method: "
        f"{r['method']}. {_why('feeding-a-gpu-from-shards-on-one-core')}",
        "",
        *rows,
        "",
        *_figures(figures),
    ]


def compile_tail(r: dict[str, Any]) -> list[str]:
    cost = r["cost_against_drop_seconds"]
    full = r["full_step_seconds"]
    return [
        "## The last partial batch under `torch.compile` (`bench/compile_tail.py`)",
        "",
        f"Machine: {r['machine']}. Method: {r['method']}. "
        f"{_why('the-last-partial-batch-under-torchcompile')}",
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
        *_figures(
            [
                ("the first compilation", f"{r['compile_seconds']:.1f} s"),
                (
                    "graphs before / after the partial batch",
                    f"{r['graphs_before_partial']} / {r['graphs_after_partial']}",
                ),
                ("recompiling against a padded step", f"{r['recompile_over_pad_per_epoch']}x"),
                (
                    "a full step before / after recompiling",
                    f"{full['before']:.3f} s / {full['after_recompile']:.3f} s",
                ),
            ]
        ),
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
        f"{r['method']}. {_why('the-checkpoint-stall')}",
        "",
        *rows,
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
    figures = [
        (
            f"{labels.get(name, name)} against plain DDP: optimizer state / memory added / "
            "images/s",
            f"{q['optimizer_state_over_ddp']}x / {q.get('rss_added_over_ddp', '-')}x / "
            f"{q['images_per_sec_over_ddp']}x",
        )
        for name, q in ratios.items()
    ]
    return [
        "## Sharded optimizer state (`bench/sharded_state.py`)",
        "",
        f"Machine: {r['machine']}; load average {r.get('load_average', '?')}. Method: "
        f"{r['method']}. DeepSpeed: {r['deepspeed']}. {_why('sharded-optimizer-state')}",
        "",
        *rows,
        "",
        *(_figures(figures) if figures else []),
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
