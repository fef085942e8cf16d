"""The file layer both stages share: the circle and .wof formats, the graph view of a
subgraph, the typed records the files carry, loading a split's files and writing files
safely."""
