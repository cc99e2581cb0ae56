"""Speculative-decoding drafters: MTP (drafters.md §1) and DSpark (drafters.md §2), plus a test oracle.

Each module holds a drafter's math and one `base.Drafter` object binding it to the loop's interface
(configure / init / observe / propose); `registry` looks them up by name.
"""
