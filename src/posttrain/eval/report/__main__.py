"""`python -m posttrain.eval.report`: posttrain-report."""

from posttrain.eval.report.command import main

if __name__ == "__main__":
    main()
