"""Speculative-decoding drafters: MTP (docs/drafter_math.md §1), DSpark (docs/drafter_math.md §2), n-gram
prompt lookup, a pool of several in one program, plus a test oracle.

Each module holds a drafter's math and one `base.Drafter` object binding it to the loop's interface
(options / configure / init / observe / propose); `registry` looks them up by name.
"""
