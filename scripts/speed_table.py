"""Print the predicted tokens/s per GPU of the GPU recipes with and without kept attention, beside the
paper's Table 3 (the tables of ``docs/benchmarks/predicted_speed.md``; ``titan_upipe.tools.speed_table``).

    .venv/bin/python scripts/speed_table.py
"""

from pathlib import Path

from titan_upipe.tools.speed_table import speed_tables
from titan_upipe.torchtitan_0_2.registry import register_plugin

if __name__ == "__main__":
    register_plugin()
    print("\n".join(speed_tables(Path(__file__).resolve().parents[1])))
