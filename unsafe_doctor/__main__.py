from unsafe_doctor.cli import main

main()
