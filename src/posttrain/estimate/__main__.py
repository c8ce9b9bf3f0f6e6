"""`python -m posttrain.estimate <overrides>`: the `posttrain-estimate` command."""

from posttrain.estimate.command import main

main()
