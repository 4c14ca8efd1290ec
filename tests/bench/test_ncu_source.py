"""bench.ncu_source reads ncu's SASS source page (CSV) and sums instructions and stall samples by opcode and run."""

from pathlib import Path

import pytest

from bench.ncu_source import parse, segments, summary

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_wait", "stall_wait (Not Issued)", "stall_long_sb"]


def _row(address: int, source: str, samples: int, executed: int, wait: int, long_sb: int) -> str:
    cells = [f"0x7f00{address:05x}", f"      {source}", str(samples), "0", f"{executed:,}", str(wait), "0", str(long_sb)]
    return ",".join(f'"{c}"' for c in cells)


def _csv(tmp_path: Path) -> Path:
    lines = ["==PROF== Connected to process 1", '"Kernel Name","qgemm_sm90_gelu_128_31_i8",', ",".join(f'"{h}"' for h in HEADER),
             _row(0x10, "IGMMA.64x128x32.S8.S8 R24, gdesc[UR8], R24", 6, 4096, 2, 0),
             _row(0x20, "@!P1  BRA 0x7f0000010", 10, 4096, 0, 10),
             _row(0x30, "MOV R1, R2", 0, 0, 0, 0),  # never ran: ends the first run
             _row(0x40, "FMUL R5, R5, UR9", 3, 8192, 3, 0),
             _row(0x50, "FMUL.FTZ R6, R6, R7", 1, 8192, 1, 0),
             _row(0x60, "@P0 MUFU.EX2 R5, R5", 0, 4096, 0, 0),
             '"Kernel Name","another_kernel",', ",".join(f'"{h}"' for h in HEADER),
             _row(0x10, "EXIT", 99, 1, 99, 0)]
    path = tmp_path / "src.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_parse_reads_the_first_kernels_rows_with_their_stall_reasons(tmp_path):
    instrs = parse(_csv(tmp_path))
    assert [i.opcode for i in instrs] == ["IGMMA", "BRA", "MOV", "FMUL", "FMUL", "MUFU"]
    assert instrs[0].executed == 4096 and instrs[1].samples == 10 and instrs[1].stalls == {"long_sb": 10}
    assert [[i.address & 0xFFF for i in run] for run in segments(instrs)] == [[0x10, 0x20], [0x40, 0x50, 0x60]]


def test_summary_counts_per_opcode_per_unit_and_ranks_runs_and_instructions(tmp_path):
    text = summary(parse(_csv(tmp_path)), per=4096, top=2)
    assert "28,672 warp instructions executed (7.00 per unit), 20 stall samples" in text
    assert any(line.split()[:3] == ["FMUL", "16,384", "4.00"] for line in text.splitlines())
    runs = [line for line in text.splitlines() if line.startswith(("00010-", "00040-"))]
    assert runs[0].split()[3:5] == ["16", "80.0%"] and "long_sb 83%, wait 17%" in runs[0]  # of its 12 reasoned samples
    assert runs[1].split()[3:5] == ["4", "20.0%"]
    assert text.splitlines()[-2].startswith("00020") and text.splitlines()[-1].startswith("00010")


def test_a_file_without_a_source_table_is_an_error_that_says_so(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== No kernels were profiled.\n")
    with pytest.raises(ValueError, match="no SASS source table"):
        parse(path)
