import sys

if sys.argv[1:2] == ["run"]:  # a graph's processes: skip typer when the command line is plain
    from dynamo_graph.cli.run import main_fast

    code = main_fast(sys.argv[2:])
    if code is not None:
        sys.exit(code)

from dynamo_graph.cli.main import main

main()
