"""The run's pictures: loss and accuracy per epoch, and the test split's confusion matrix.

Drawn on the orchestrator from the trainer's ``metrics.json`` and the scorer's ``score.json``,
as PNG bytes, so the same images go into the summary artifact (embedded: a link to private Blob
would need a signature, which never goes into an artifact) and into the run's outputs. Small on
purpose (about 600x400 pixels) so the summary stays light in the Prefect database.

matplotlib is imported inside the drawing functions: importing this module (and the flow) stays
cheap, and its ``Figure`` is used without pyplot, so no global backend or figure state is touched
by a flow that runs tasks in threads.

Text that comes from the data (class names) is drawn as written, never parsed as matplotlib's
mathtext. A picture is an illustration of figures the run has already recorded: the report
leaves out a chart that cannot be drawn and names it (``tasks/report.py``), it never fails a run.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH, HEIGHT, DPI = 7.5, 5.0, 80  # inches at 80 dpi: 600x400 pixels
# Longer class names are cut (with an ellipsis) on the axes: a folder name may be 255 bytes, and
# labels that long leave the matrix no room (the per-class table has the names in full).
LABEL_CHARS = 24


def _png(fig: Figure) -> bytes:
    """The figure as an 8-bit palette PNG: a third of the size of matplotlib's RGBA one, and a
    chart has far fewer than 256 colours to lose."""
    from PIL import Image

    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=DPI)
    with Image.open(io.BytesIO(drawn.getvalue())) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue()


def curves_png(epochs: Sequence[dict[str, Any]]) -> bytes:
    """Training loss (left) and train/validation accuracy (right) for each recorded epoch."""
    from matplotlib.figure import Figure

    if not epochs:
        raise ValueError("metrics.json: epochs is empty, there is no curve to draw")
    for i, e in enumerate(epochs):
        missing = {"epoch", "train_loss", "train_accuracy"} - set(e)
        if missing:
            raise ValueError(f"metrics.json: epochs[{i}] has no {', '.join(sorted(missing))}")
    x = [int(e["epoch"]) for e in epochs]
    fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    loss, accuracy = fig.subplots(1, 2)
    loss.plot(x, [float(e["train_loss"]) for e in epochs], marker="o", label="train")
    loss.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    accuracy.plot(x, [float(e["train_accuracy"]) for e in epochs], marker="o", label="train")
    val = [(int(e["epoch"]), float(e["val_accuracy"])) for e in epochs if "val_accuracy" in e]
    if val:
        accuracy.plot(*zip(*val, strict=True), marker="s", label="validation")
    accuracy.set(title="Accuracy", xlabel="epoch", ylabel="fraction correct", ylim=(0, 1.02))
    for ax in (loss, accuracy):
        ax.set_xticks(x if len(x) <= 12 else x[:: max(1, len(x) // 12)])
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    return _png(fig)


def confusion_png(matrix: Sequence[Sequence[int]], class_names: Sequence[str]) -> bytes:
    """Counts of test images by true class (rows) and predicted class (columns)."""
    from matplotlib.figure import Figure

    n = len(class_names)
    if n == 0 or len(matrix) != n or any(len(row) != n for row in matrix):
        shape = f"{len(matrix)}x{len(matrix[0]) if matrix else 0}"
        raise ValueError(
            f"score.json: confusion_matrix is {shape} but class_names names {n} classes"
        )
    fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, label="images")
    ticks = list(range(n))
    names = [
        name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "…" for name in class_names
    ]
    # Class names are folder names, shown as written: with math parsing on, a name such as
    # "$x^$" fails the drawing (a mathtext syntax error) and "${{{...}}}$" recurses too deep.
    ax.set_xticks(ticks, names, rotation=45, ha="right", parse_math=False)
    ax.set_yticks(ticks, names, parse_math=False)
    ax.set(title="Confusion matrix (test split)", xlabel="predicted", ylabel="true")
    if n <= 20:  # beyond that the numbers no longer fit in their cells
        top = max((max(row) for row in matrix), default=0)
        for i, row in enumerate(matrix):
            for j, count in enumerate(row):
                colour = "white" if top and count > top / 2 else "black"
                ax.text(j, i, str(count), ha="center", va="center", color=colour, fontsize=8)
    return _png(fig)
