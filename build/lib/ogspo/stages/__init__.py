"""One module per workflow rule: read the inputs, call the layers below, write the outputs."""
