from harness.app import main

main()
