"""Instructions of the committed optimized HLO files: all, and inside fused computations
those with a scalar result and the others.

    python experiments/nanogpt/results/h100/data_barrier/count_hlo.py
"""
import gzip
import pathlib
import re

INSTR = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+[a-z]")
for path in sorted(pathlib.Path(__file__).parent.glob("hlo_*.txt.gz")):
    total = fused_scalar = fused_other = 0
    for comp in re.split(r"\n(?=\S)", gzip.open(path, "rt").read()):
        fused = comp.startswith(("%fused", "fused"))
        for line in comp.splitlines()[1:]:
            m = INSTR.match(line)
            if m is None:
                continue
            total += 1
            if fused and "parameter(" not in line and "constant(" not in line:
                if re.match(r"^[a-z0-9]+\[\]", m.group(1)):
                    fused_scalar += 1
                else:
                    fused_other += 1
    print(f"{path.name}: {total:,} instructions; in fused computations {fused_scalar:,} scalar, "
          f"{fused_other:,} others (parameters and constants left out)")
