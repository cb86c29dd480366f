from onepass.harness.app import main

main()
