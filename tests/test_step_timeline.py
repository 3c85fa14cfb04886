"""tools/step_timeline.py's summary of recorded rows (the recording itself needs a GPU)."""
from helpers import load_tool


def test_summary_of_one_step_counts_its_copies_flushes_and_gc_passes():
    """Rows as the tool saves them: (label, device ms or None for host-only rows, host ms, extra)."""
    rows = [("gc", None, -5.0, [2, 300.0]),  # before the step: not counted
            ("step_begin", 0.0, 0.0, 3), ("fwd_end", 100.0, 50.0, None),
            ("gc", None, 60.0, [0, 1.5]), ("gc", None, 70.0, [2, 290.0]),
            ("flush", 120.0, 110.0, None), ("h2d_begin", 125.0, 111.0, None), ("h2d_end", 140.0, 112.0, None),
            ("d2h_begin", 141.0, 113.0, None), ("d2h_end", 160.0, 114.0, None),
            ("flush", 150.0, 149.0, None), ("step_end", 200.0, 190.0, 3)]
    lines = load_tool("step_timeline").summarize(rows)
    assert lines[0] == "== step 3: 200.0 ms on the device, 190.0 ms on the host"
    assert "  Python GC: 2 passes, 291.5 ms on the host; 1 full, 290.0 ms" in lines
    assert "  forward ends: device 100.0 ms, host 50.0 ms" in lines
    assert any(line.startswith("  2 release batches, device 120.0..150.0 ms; device lag behind the host at a "
                               "flush: median 10.0 ms") for line in lines)
    assert "  h2d: 1 copy calls, device 125.0..140.0 ms, busy 15.0 ms" in lines
    assert "  d2h: 1 copy calls, device 141.0..160.0 ms, busy 19.0 ms" in lines
