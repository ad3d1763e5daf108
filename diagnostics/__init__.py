"""Pure judgement: Xid catalog, node verdict, dead-vs-slow vote, collective contract, planners. No I/O."""
