# Runs a command that must fail: exit status EXPECT_RC and stderr matching EXPECT_STDERR.
# Used by ctest for the command line's argument errors (a crash or a silent success fails it).
#   cmake "-DCOMMAND=<exe>|<arg>|..." -DEXPECT_RC=2 -DEXPECT_STDERR=<regex> -P expect_failure.cmake
# ('|' separates the arguments: ctest would split a ';'-list into arguments of cmake itself.)
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT_RC}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT err MATCHES "${EXPECT_STDERR}")
  message(FATAL_ERROR "stderr does not match '${EXPECT_STDERR}':\n${err}")
endif()
