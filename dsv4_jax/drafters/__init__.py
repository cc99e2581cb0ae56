"""Speculative-decoding drafters: MTP (docs/drafter_math.md §1) and DSpark (docs/drafter_math.md §2), plus a test oracle.

Each module holds a drafter's math and one `base.Drafter` object binding it to the loop's interface
(configure / init / observe / propose); `registry` looks them up by name.
"""
