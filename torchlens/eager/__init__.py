"""The eager substrate: capture by `TorchFunctionMode` plus module hooks."""
