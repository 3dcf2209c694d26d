"""DeepSeek-V3: MLA attention, block-fp8 linears, the grouped router and routed experts, MTP weights."""
