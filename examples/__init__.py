"""Example user projects for trainserve: each uses only the component contract (README, "Train your
own model"), nothing of trainserve's internals. Run from the repository root, where `examples` is
importable."""
