from cramswarm.cli import main

raise SystemExit(main())
