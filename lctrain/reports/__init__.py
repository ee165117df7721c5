"""Reports on data and runs: dataset statistics (`inspect_data`, Table 9 and Figure 8), the training-time estimate
and its measurement (`estimate`, `throughput`, Figure 6), and the figures they draw (`plots`)."""
