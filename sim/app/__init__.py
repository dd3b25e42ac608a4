"""The application layer: the `sim` command line and the work it orchestrates (replay, sweeps,
capacity search, compare, calibrate), and safe outputs. It may import every layer below it;
nothing imports it."""
