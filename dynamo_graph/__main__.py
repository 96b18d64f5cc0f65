from dynamo_graph.cli.main import main

main()
