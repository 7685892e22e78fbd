"""Draw docs/engram.png: how one Engram layer reads its table (the README's picture).

Left to right, for one position t of one sequence (SPEC.md §2-§6, V4.1's sizes): the last four
tokens, their compressed ids, one mix per n-gram order hashed into 8 heads each, 24 rows of the
layer's table, the fused `wkv` projection into one key per residual stream and one shared value, the
gate per stream, and the streams with the gated value added. Run from anywhere:

    python docs/figures/make_engram_png.py          # writes docs/engram.png beside this folder
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

OUT = Path(__file__).resolve().parent.parent / "engram.png"

INK = "#1f2933"
GREY = "#6b7280"
BLUE = "#dbeafe"  # addressing: known from token ids alone
GREEN = "#dcfce7"  # storage
ORANGE = "#ffedd5"  # compute with the hidden state
VIOLET = "#ede9fe"  # the residual streams
ORDER_COLOURS = ("#60a5fa", "#34d399", "#f59e0b")  # 2-, 3-, 4-grams


def box(ax, x, y, w, h, text, face, size=9.5, weight="normal"):
    """A rounded box with centred text; returns its (left, bottom, width, height)."""
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=face, ec=INK, lw=1.0)
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=INK, weight=weight)
    return x, y, w, h


def arrow(ax, start, end, colour=INK, lw=1.2, style="-|>"):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=11, color=colour, lw=lw, shrinkA=0, shrinkB=0
        )
    )


def stage_title(ax, x, text):
    ax.text(x, 5.55, text, ha="center", va="bottom", fontsize=10, color=INK, weight="bold")


def main() -> None:
    fig, ax = plt.subplots(figsize=(15, 6.2))
    ax.set_xlim(0, 15.45)
    ax.set_ylim(-0.35, 6.1)
    ax.axis("off")

    # 1. tokens -> compressed ids
    stage_title(ax, 1.0, "tokens")
    # "LORD spake unto" in the DeepSeek-V4 tokenizer: its ids and their compressed ids
    # (engram.TokenizerCompression.from_tokenizer("deepseek-v4"), 129,280 ids -> 99,092)
    tokens = [" LORD", " sp", "ake", " unto"]
    token_ids = [39297, 878, 877, 29122]
    ids = ["6461", "730", "729", "19139"]
    for i, (tok, tid, cid) in enumerate(zip(tokens, token_ids, ids, strict=True)):
        y = 4.55 - i * 0.95
        box(ax, 0.2, y, 1.6, 0.6, f'"{tok}"  {tid}', BLUE, size=9)
        box(ax, 2.45, y, 1.15, 0.6, cid, BLUE, size=9.5)
        arrow(ax, (1.8, y + 0.3), (2.45, y + 0.3), colour=GREY)
    stage_title(ax, 3.02, "compressed ids")
    ax.text(
        1.9,
        0.55,
        "compression: ids whose text normalises\nalike share one id: Apple, apple, \u2423apple,\n\u2423Apple (4 ids) \u2192 12850",
        ha="center",
        va="center",
        fontsize=8,
        color=GREY,
    )
    ax.text(0.2, 5.25, "the last 4 tokens up to position t, their ids", fontsize=8, color=GREY, va="bottom")

    # 2. n-gram mixes -> 8 heads each
    stage_title(ax, 5.3, "2/3/4-gram hashes")
    mixes = [
        ("2-gram: mix\u2082 = x\u209c\u00b7m\u2080 \u2295 x\u209c\u208b\u2081\u00b7m\u2081", 4.35),
        ("3-gram: mix\u2083 = mix\u2082 \u2295 x\u209c\u208b\u2082\u00b7m\u2082", 3.05),
        ("4-gram: mix\u2084 = mix\u2083 \u2295 x\u209c\u208b\u2083\u00b7m\u2083", 1.75),
    ]
    for (text, y), colour in zip(mixes, ORDER_COLOURS, strict=True):
        ax.add_patch(
            FancyBboxPatch(
                (4.0, y), 2.6, 0.8, boxstyle="round,pad=0.02,rounding_size=0.08", fc=BLUE, ec=colour, lw=2
            )
        )
        ax.text(5.3, y + 0.53, text, ha="center", va="center", fontsize=7.8, color=INK)
        ax.text(
            5.3, y + 0.2, "8 heads: row = mix mod p\u2096", ha="center", va="center", fontsize=8, color=GREY
        )
        arrow(ax, (3.8, y + 0.4), (4.0, y + 0.4), colour=GREY, lw=0.9)
    ax.plot([3.8, 3.8], [2.15, 4.85], color=GREY, lw=0.9)  # every id feeds the mixes
    for i in range(4):
        ax.plot([3.6, 3.8], [4.85 - i * 0.95, 4.85 - i * 0.95], color=GREY, lw=0.9)
    ax.text(
        5.3,
        0.95,
        "row ids depend on token ids only:\nknown before the forward pass, prefetched",
        ha="center",
        va="center",
        fontsize=8,
        color=GREY,
        style="italic",
    )

    # 3. the table: 24 rows of one layer's table
    stage_title(ax, 7.58, "table rows")
    ax.add_patch(Rectangle((7.1, 0.9), 0.95, 4.5, fc=GREEN, ec=INK, lw=1.0))
    rows = {
        0: [5.1, 4.9, 4.6, 4.45, 4.2, 3.95, 3.8, 3.6],
        1: [3.3, 3.1, 2.95, 2.75, 2.5, 2.35, 2.1, 1.95],
        2: [1.8, 1.65, 1.5, 1.4, 1.3, 1.2, 1.1, 1.0],
    }
    for order, ys in rows.items():
        for y in ys:
            ax.add_patch(Rectangle((7.1, y), 0.95, 0.055, fc=ORDER_COLOURS[order], ec="none"))
        arrow(ax, (6.6, mixes[order][1] + 0.4), (7.1, sum(ys) / len(ys)), colour=ORDER_COLOURS[order], lw=1.4)
    ax.text(
        7.55,
        0.55,
        "one table a layer (V4.1: 384M rows)\n24 rows \u00d7 256, FP8 + ue8m0 scales",
        ha="center",
        va="center",
        fontsize=8,
        color=GREY,
    )

    # 4. wkv -> keys per stream + value
    stage_title(ax, 9.45, "wkv")
    box(ax, 8.75, 2.55, 1.4, 1.3, "wkv\n6144 \u2192\n(hc+1)\u00b7dim\n= 25600", ORANGE, size=9)
    arrow(ax, (8.05, 3.2), (8.75, 3.2))
    ax.text(8.4, 3.35, "flatten", ha="center", va="bottom", fontsize=7.5, color=GREY)
    stage_title(ax, 11.05, "keys + value")
    keys_y = [4.6, 3.85, 3.1, 2.35]
    for m, y in enumerate(keys_y):
        box(ax, 10.55, y, 1.0, 0.5, f"key k{m + 1}", ORANGE, size=9)
        arrow(ax, (10.15, 3.2), (10.55, y + 0.25), colour=GREY, lw=0.9)
    box(ax, 10.55, 1.2, 1.0, 0.6, "value v", ORANGE, size=9, weight="bold")
    arrow(ax, (10.15, 3.0), (10.55, 1.5), colour=GREY, lw=0.9)

    # 5. gate per stream
    stage_title(ax, 12.5, "gate")
    for m, y in enumerate(keys_y):
        box(ax, 11.95, y, 1.1, 0.5, f"g{m + 1}", ORANGE, size=9)
        arrow(ax, (11.55, y + 0.25), (11.95, y + 0.25), colour=GREY, lw=0.9)
    ax.text(
        12.75,
        1.85,
        "g\u2098 = \u03c3(signed \u221a(normalised h\u2098\u00b7k\u2098)),\nh\u2098 the stream\u2019s hidden state",
        ha="center",
        va="center",
        fontsize=8,
        color=GREY,
    )

    # 6. residual streams
    stage_title(ax, 14.25, "residual streams")
    for m, y in enumerate(keys_y):
        box(ax, 13.55, y, 1.4, 0.5, f"h{m + 1} += g{m + 1}\u00b7v", VIOLET, size=9)
        arrow(ax, (13.05, y + 0.25), (13.55, y + 0.25), colour=GREY, lw=0.9)
    ax.plot([11.05, 11.05, 15.2, 15.2], [1.2, 0.85, 0.85, keys_y[0] + 0.25], color=INK, lw=1.1)
    for y in keys_y:  # v into every stream
        arrow(ax, (15.2, y + 0.25), (14.95, y + 0.25))
    ax.text(12.65, 0.62, "the same v for every stream", ha="center", va="center", fontsize=8, color=GREY)

    ax.text(
        0.2,
        -0.25,
        "One Engram layer at position t (DeepSeek-V4.1: layers 1 and 14, hc = 4 streams of dim 5120). "
        "Colours: blue = addressing (token ids only), green = storage, orange = compute with the hidden state.",
        fontsize=8,
        color=GREY,
        va="center",
    )
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(OUT)


if __name__ == "__main__":
    main()
