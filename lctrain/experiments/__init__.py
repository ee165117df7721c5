"""Bundled experiments: a paper comparison run end to end by one command, through the ordinary stages (`prepare`,
`train`, `eval`, `report`) in fresh processes. `extend`: the headline comparison of attention modes, small."""
