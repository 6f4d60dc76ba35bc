from mlx_watchdog.cli import main

main()
