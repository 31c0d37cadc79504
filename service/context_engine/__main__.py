from context_engine.cli import main

raise SystemExit(main())
