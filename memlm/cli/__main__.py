from memlm.cli import main

main()
