"""Ahead-of-time compile, fit and traffic reports for TPU topologies, on a CPU machine (`dsv4-aot`).

    chips        TPU generations (HBM, bandwidth, peak rates), topology names, libtpu's abstract devices
    inputs       abstract sharded parameters / decode states / loop carries (ShapeDtypeStruct + NamedSharding)
    programs     the compiled programs: prefill chunk, decode, verify, one MTP / DSpark speculative round
    bounds       the bytes each program must read (the project's bytes model + the drafters' passes)
    compile      compile one program; memory / cost analysis, HLO analysis, fit, time estimates
    hlo          HLO text: instructions, bytes per op, top ops, collectives
    kernel_hook  the Mosaic TPU kernels' own AOT numbers, when their helper exists
    runner       topology × weights × programs -> the report dict
    report       JSON, Markdown and plot
    cli          the `dsv4-aot` command
    placement_table  `dsv4-aot placements`: the expert-parallel study's placements side by side
    fit_summary  `dsv4-aot fit-table`: the README's fit table from saved reports
"""
