from runner.cli.main import main

main()
