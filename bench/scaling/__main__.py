from bench.scaling.run import main

main()
