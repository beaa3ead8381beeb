"""A table as GitHub Markdown, cells in human form: the report's and the comparison's tables.
(pandas' `to_markdown` needs `tabulate`, which the environment does not carry.)"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        # iterrows widens int columns to float; byte and token counts should still read as integers.
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table of `df` with its index as the first column (pandas' to_markdown
    needs `tabulate`, which the environment does not carry)."""
    header = [df.index.name or ""] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for idx, row in df.iterrows():
        lines.append("| " + " | ".join([_cell(idx)] + [_cell(v) for v in row.tolist()]) + " |")
    return "\n".join(lines)
